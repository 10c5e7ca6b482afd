#!/usr/bin/env bash
# The next GPU window's two device commands (docs/gpu.md, "Next on a GPU"), rehearsed on the CPU as the device runs
# them: the second on the same OUTDIR as the first (so `policy` goes on from the first call's partial table), each
# archive unpacked into bench/results/cpu-rehearsal/next-window/callN/ beside its command.txt and stdout.txt.
# Run from the repository root with the host's software first on PATH (bench/rehearsal_env.sh VENV):
#   PATH=VENV/bin:$PATH bench/scripts/rehearse_next_window.sh
set -uo pipefail
here=bench/results/cpu-rehearsal/next-window
work=$(mktemp -d)
out=$work/gc  # one OUTDIR for both calls, as /tmp/gc on the device
source bench/scripts/rehearse_call.sh
# The two commands of docs/gpu.md, word for word but for --rehearse and the folders.
rehearse_call "$here/call1" "$work/call.tar.gz" "$out" host engine engine-host gemm-shares \
  interference:green-static-96-smtarget,mps-40 policy
rehearse_call "$here/call2" "$work/call.tar.gz" --budget 180 "$out" tests-gpu:test_engine.py policy
rm -rf "$work"
