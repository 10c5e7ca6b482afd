#!/usr/bin/env bash
# Validate a GPU host for ppd-serve, writing every raw output and log into OUTDIR.
#
#   bench/gpu_check.sh OUTDIR [STEP ...]      steps: probe tests engine sampling compare kernels policy policy-eval:W
#                                             policy-verdict partition partition-compare interference[:NAMES]
#                                             frontend[:COUNTS]
#                                             (default: probe tests engine compare)
#
#   probe    ppd probe: GPUs, CUDA IPC, MPS, kernel overlap, green contexts        -> probe.json, probe.log
#   tests    the gpu-marked tests, then the kernel tests (their small cases run on CUDA too) -> tests.log
#   engine   ppd bench engine on Llama-3.1-8B's config with random weights          -> engine-*.{json,md}, engine.log
#   sampling ppd bench sampling on the same model: each sampling feature's decode step against greedy at batches
#            1, 64, 256 (structured outputs on a byte-level stand-in tokenizer)     -> sampling/, sampling.log
#   compare  a short ppd bench compare of pd, dlocal and aggregated on the same model -> compare/, compare.log
#   kernels  python -m bench.kernels: each kernel's configs at real sizes (slow)     -> kernels/, kernels.log
#   policy   ppd profile policy on the same model, 10 s runs (resumable: OUTDIR/policy.json) -> policy.*, policy.log
#   policy-eval:W  ppd against pd, dlocal, aggregated on workload W (decode-heavy, balanced, prefill-heavy) at
#                $POLICY_QPS conversations/s (default 2), one 30 s run each (reads OUTDIR/policy.json; about
#                8 minutes, so one workload per device call)                     -> policy-eval/W/, policy-eval-W.log
#   policy-verdict the verdict over the policy-eval workloads present           -> policy-eval/verdict.md
#   partition  ppd profile partition on the same model: decode step by SMs x batch x context, prefill speed,
#              decode TPOT beside 1 and 4 full or append prefills (green-context streams; resumable)
#                                                                                -> partition.{json,md,png}, partition.log
#   partition-compare  pd and aggregated on the balanced workload with --partition none (time-sliced), mps (two
#              MPS processes) and green (one process, green-context splits), 30 s at 2 conversations/s each
#                                                                                -> partition-compare/{none,mps,green}/
#   interference[:NAMES]  decode TPOT at batch 64 alone and beside 4K-token prefills, for aggregated, none, mps and
#              green in one run (or the comma list NAMES of them)             -> interference/, interference.log
#   frontend[:COUNTS]  ppd bench frontend (the stub engine, no GPU used) at 500, 1,000 and 2,000 streams from 4 client
#              processes, for each --api-server-count in COUNTS (default 1,4,8)   -> frontend/api-N/, frontend-N.log
#
# Run it from the repository root. Python packages the host lacks can come as wheels in .whl/
# (../shared/device/wheels.sh openai distro jiter uvloop httptools aiohttp): they are installed into /tmp/site first.
# Each step's exit status is in OUTDIR/status.txt; the script's own status is that of the last step.
set -uo pipefail

if [ $# -lt 1 ]; then
  sed -n '/^set -uo/q;2,$p' "$0" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(probe tests engine compare)
cd "$(dirname "$0")/.."

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
ppd=(python3 -m server.cli)
llama="--model bench/models/llama-3.1-8b --load-format dummy --skip-tokenizer-init"

{
  date -u
  git rev-parse HEAD 2>/dev/null
  nvidia-smi 2>&1
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} >"$out/host.txt" 2>&1

run_step() {
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$out/status.txt"
  local started=$SECONDS
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - started)) s" | tee -a "$out/status.txt"
  return "$rc"
}

rc=0
for step in "${steps[@]}"; do
  case $step in
    probe)
      run_step probe "${ppd[@]}" probe --out "$out/probe.json"; rc=$? ;;
    tests)
      run_step tests bash -c "python3 -m pytest -q -rs -m gpu tests; r1=\$?; \
python3 -m pytest -q -rs tests/engine/kernels; r2=\$?; exit \$(( r1 > r2 ? r1 : r2 ))"; rc=$? ;;
    engine)
      run_step engine "${ppd[@]}" bench engine --out "$out"; rc=$? ;;
    sampling)
      run_step sampling "${ppd[@]}" bench sampling --out "$out/sampling"; rc=$? ;;
    compare)
      run_step compare "${ppd[@]}" bench compare --policies pd,dlocal,aggregated --serve-args "$llama" \
        --api completions --workload synthetic --profile balanced --turn1 short --turns 3 \
        --qps 2 --duration 40 --timeout 120 --repeat 1 --goodput ttft:500 tpot:50 --no-progress \
        --out "$out/compare"; rc=$? ;;
    kernels)
      run_step kernels python3 -m bench.kernels --out "$out/kernels"; rc=$? ;;
    policy)
      run_step policy "${ppd[@]}" profile policy --serve-args "$llama" --duration 10 --no-progress \
        --out "$out/policy.json"; rc=$? ;;
    policy-eval:*)
      w=${step#policy-eval:}
      run_step "policy-eval-$w" "${ppd[@]}" bench compare --policies pd,dlocal,ppd,aggregated \
        --serve-args "$llama --policy-table $out/policy.json" --api completions --workload synthetic --profile "$w" \
        --turn1 mixed --qps "${POLICY_QPS:-2}" --duration 30 --timeout 120 --repeat 1 --no-progress \
        --out "$out/policy-eval/$w"; rc=$? ;;
    policy-verdict)
      run_step policy-verdict bash -c "python3 -m bench.policy_eval $out/policy-eval/*/ --out $out/policy-eval/verdict.md"
      rc=$? ;;
    partition)
      run_step partition "${ppd[@]}" profile partition --no-progress --out "$out/partition.json"; rc=$? ;;
    partition-compare)
      for p in none mps green; do
        run_step "partition-compare-$p" "${ppd[@]}" bench compare --policies pd,aggregated \
          --serve-args "$llama --partition $p" --api completions --workload synthetic --profile balanced \
          --turn1 mixed --qps 2 --duration 30 --timeout 120 --repeat 1 --goodput ttft:500 tpot:50 --no-progress \
          --out "$out/partition-compare/$p"; rc=$?
      done ;;
    interference|interference:*)
      only=(); [ "$step" != interference ] && only=(--only "${step#interference:}")
      run_step interference "${ppd[@]}" bench interference --serve-args "$llama --device cuda --gpus 0" \
        --batch 64 --context 1024 --prefill-tokens 4096 --rounds 5 "${only[@]}" --out "$out/interference"; rc=$? ;;
    frontend|frontend:*)
      counts=1,4,8; [ "$step" != frontend ] && counts=${step#frontend:}
      for n in ${counts//,/ }; do
        run_step "frontend-$n" "${ppd[@]}" bench frontend --streams 500,1000,2000 --tokens 256 --step-ms 20 --rounds 3 \
          --client-procs 4 --serve-args "--device cpu --api-server-count $n" --out "$out/frontend/api-$n"; rc=$?
      done ;;
    *)
      echo "unknown step $step (probe tests engine sampling compare kernels policy policy-eval:W policy-verdict partition" \
        "partition-compare interference[:NAMES] frontend[:COUNTS])" >&2; rc=2 ;;
  esac
done
exit "$rc"
