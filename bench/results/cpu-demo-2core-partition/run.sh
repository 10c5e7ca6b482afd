#!/usr/bin/env bash
# The CPU demo model on 2 cores: the balanced two-turn workload at 6 conversations/s, 20 s per run, 3 rounds,
# each round a fresh server per setting:
#   partition-cpu-rR / partition-none-rR  --partition cpu (each worker its own core) against none (both on both)
#   manager-managed-rR / manager-static-rR  --share-manager (with the shipped partition profile) against without
set -euo pipefail
OUT=$(cd "$(dirname "$0")" && pwd)
run() {  # NAME SERVE-ARGS...
  local name=$1; shift
  ppd serve --port 8133 "$@" > "/tmp/$name.log" 2>&1 &
  local server=$!
  for _ in $(seq 60); do curl -sf http://127.0.0.1:8133/health > /dev/null && break; sleep 1; done
  ppd bench --url http://127.0.0.1:8133 --profile balanced --turn1 mixed --scale 0.125 --num-conversations 300 \
    --qps 6 --duration 20 --api completions --no-progress --out "$OUT/$name"
  kill -TERM $server; wait $server || true
}
for r in 0 1 2; do
  run partition-cpu-r$r --partition cpu
  run partition-none-r$r --partition none
done
for r in 0 1 2; do
  run manager-managed-r$r --share-manager
  run manager-static-r$r
done
