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
n=0
call() {  # call GPU_CHECK_ARGS...
  n=$((n + 1))
  local dest=$here/call$n
  rm -rf "$dest" && mkdir -p "$dest"
  echo "bench/gpu_check.sh --rehearse $* (OUTDIR and archive under a temporary folder) -> call$n/" | tee "$dest/command.txt"
  bench/gpu_check.sh --rehearse "$@" >"$dest/stdout.txt" 2>&1
  echo "exit $?" >>"$dest/command.txt"
  tar -xzf "$work/call.tar.gz" -C "$dest" && rm "$work/call.tar.gz"
  tail -1 "$dest/stdout.txt"
}
# The two commands of docs/gpu.md, word for word but for --rehearse and the folders.
call --archive "$work/call.tar.gz" "$out" host engine engine-host gemm-shares \
  interference:green-static-96-smtarget,mps-40 policy
call --budget 180 --archive "$work/call.tar.gz" "$out" tests-gpu:test_engine.py policy
rm -rf "$work"
