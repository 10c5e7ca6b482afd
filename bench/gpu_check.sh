#!/usr/bin/env bash
# Validate a GPU host for ppd-serve, one device call at a time (bench/gpu_check.py says how a call is built):
#
#   bench/gpu_check.sh [--rehearse] [--archive FILE] [--from DIR] [--budget S] [--plan] OUTDIR [STEP ...]
#
#   host       imports every module the steps need and every module of the project (seconds), after the carried
#              ../shared/device/host_check.py when it is in .whl/
#   probe      ppd probe: GPUs, CUDA IPC, MPS, kernel overlap, green contexts          -> probe.json
#   tests      the gpu-marked tests, then the kernel tests (their small cases run on CUDA)  -> tests-*.xml
#              (tests-gpu or tests-kernels: one of the two; tests-gpu:FILES only those files, each a path or a
#              file name, e.g. tests-gpu:test_engine.py,tests/server/test_gpu_serve.py)
#   engine     ppd bench engine on Llama-3.1-8B's config with random weights: decode, prefill, append and mixed
#              steps beside their floors, graphs on and off, host time per step        -> engine-*.{json,md}
#   engine-host  python -m bench.engine_host: one eager decode step (32 x 1K) and one 256-token append over 4K
#              under torch.profiler, host time by kind of op (under a minute)           -> engine-host.{json,md}
#   sampling   ppd bench sampling: each sampling feature's decode step against greedy   -> sampling/
#   compare    ppd bench compare of pd, dlocal and aggregated, balanced workload, 2 conversations/s -> compare/
#   agents     ppd bench compare of agent sessions (issue 47) on a pool cut so that they spill: no second KV tier,
#              a tier of pinned host memory, and the tier with retention hints           -> agents/
#   moe        ppd bench engine on Qwen3-30B-A3B's config with random weights (decode at batch 1-128, a 4K
#              prefill, a 256-token append, floors counting the experts routed to), then bench.kernels --only
#              moe (the fused layer from 1 to 4096 tokens over its tiles)                -> moe/, moe-kernels/
#   kernels    python -m bench.kernels: each kernel's configs at real sizes             -> kernels/
#   policy     ppd profile policy, 10 s runs (resumable: OUTDIR/policy.json)             -> policy.{json,md,png}
#   policy-eval:W   ppd against pd, dlocal, aggregated on workload W (decode-heavy, balanced, prefill-heavy) at
#              $POLICY_QPS conversations/s (default 2), reading OUTDIR/policy.json       -> policy-eval/W/
#   policy-verdict  the verdict over the policy-eval workloads present                 -> policy-eval/verdict.md
#   partition  ppd profile partition: decode step by SMs x batch x context, prefill speed, decode beside prefills
#              (green-context streams; resumable)                                        -> partition.{json,md,png}
#   partition-compare[:NAMES]  pd and aggregated, balanced workload, with --partition none, mps, green
#                                                                                         -> partition-compare/NAME/
#   interference[:NAMES]  decode TPOT at batch 64 alone and beside 4K-token prefills, per configuration of
#              bench/interference.py's GPU_CONFIGS (NAMES: some of them; rehearsed as the CPU's stand-in for each
#              one's partition)                                                           -> interference/
#   frontend[:COUNTS]  ppd bench frontend (stub engine) at 500, 1,000, 2,000 streams from 4 client processes, per
#              --api-server-count in COUNTS (default 1,4,8). It needs no GPU: run it on the CPU (a host with
#              enough cores), not in a device call                                        -> frontend/api-N/
#   (default: host probe tests)
#
# Every step runs under its own time limit within the call's budget (570 s from gpu_check.py's start; with the
# wheel install below, about 585 s of a device command's 600), every server it starts logs into OUTDIR, and each
# step's verdict goes to OUTDIR/steps.json and status.txt. --archive packs OUTDIR into one .tar.gz under 16 MiB at
# the end, whatever happened. --plan prints the steps' limits and expected durations against the budget and runs
# nothing. --rehearse runs every step on the CPU with a shrunk stand-in of the model. Exit status: 0 when every
# step is ok, 1 otherwise, 2 for a bad command line.
#
# Wheels in .whl/ (../shared/device/wheels.sh) are installed into /tmp/site first, as on the GPU host.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$root"/.whl/*.whl || { echo "error: installing .whl/ into /tmp/site failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$root
else
  export PYTHONPATH=$root
fi
export PYTHONUNBUFFERED=1
exec python3 -m bench.gpu_check "$@"
