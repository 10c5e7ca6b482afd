#!/usr/bin/env bash
# Overload on the CPU demo model: a server limited to 16 running sequences (and, by default, 16 waiting), loaded by
# closed-loop clients at capacity (16) and at 10x (160), 30 s per point. Clients that honor Retry-After (default,
# as OpenAI's SDK does) and clients that retry at once (--ignore-retry-after): RUNS="0 1 2" MODE=honor|ignore.
set -euo pipefail
OUT=$(cd "$(dirname "$0")" && pwd)
MODE=${MODE:-honor}
FLAG=$([ "$MODE" = ignore ] && echo --ignore-retry-after || true)
ppd serve --port 8124 --max-num-seqs 16 --max-num-batched-tokens 512 > "/tmp/overload-serve-$MODE.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER; wait $SERVER || true' EXIT
for _ in $(seq 60); do curl -sf http://127.0.0.1:8124/health > /dev/null && break; sleep 1; done
for r in ${RUNS:-0 1 2}; do
  for c in 16 160; do
    ppd bench --url http://127.0.0.1:8124 --concurrency $c --duration 30 --api completions --scale 0.05 --turns 2 \
      --no-progress $FLAG --out "$OUT/$MODE-c$c-run$r"
  done
done
