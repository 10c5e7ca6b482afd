#!/usr/bin/env bash
# Turn-2+ TTFT of the same 3-turn conversations through chat completions (the client resends the text history,
# which the server re-tokenizes) and through stored responses (previous_response_id: the server keeps the ids).
# A fresh `ppd serve` (the demo model, defaults) for each API, so that neither finds the other's cache.
# Usage: run.sh OUT_FOLDER [SERVE_ARGS...]
set -euo pipefail
out=${1:?usage: run.sh OUT_FOLDER [SERVE_ARGS...]}
shift
port=8431
for api in chat responses; do
  ppd serve --port "$port" "$@" > "$out/$api.serve.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
  timing=()
  [ "$api" = chat ] && timing=(--token-timing)  # chat: time tokens, not text (see the README)
  ppd bench --url "http://127.0.0.1:$port" --api "$api" "${timing[@]}" --workload uniform --turns 3 \
    --user-tokens 200-400 --output-tokens 64 --concurrency 4 --duration 60 --no-progress --out "$out/$api"
  kill -INT $server
  wait $server || true
done
