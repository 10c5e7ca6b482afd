#!/usr/bin/env bash
# CoreWatch on and off (PPD_CORE_WATCH=0), alone and beside a busy loop pinned to core 1: ppd serve on SmolLM2
# (--model smollm2), 4-turn ShareGPT conversations, 2 in flight, 30 s a run, 2 rounds, the client on the same
# machine. Prints each run's TPOT p50 (ms) and output tokens/s. Usage: bench/scripts/core_watch_ab.sh OUT
set -uo pipefail
out=${1:?usage: bench/scripts/core_watch_ab.sh OUT}
mkdir -p "$out"
folder=$(python -c "from engine.gguf import model_folder, smollm2_gguf; print(model_folder(smollm2_gguf()))")
for round in 0 1; do
for watch in 1 0; do
  PPD_CORE_WATCH=$watch python -m cli serve --model smollm2 --max-model-len 8192 --kv-cache-memory 2 --port 8123 > "$out/serve-watch$watch-round$round.log" 2>&1 &
  srv=$!
  for i in $(seq 120); do curl -s localhost:8123/health | grep -q '"ok"' && break; sleep 1; done
  for busy in 0 1; do
    if [ $busy = 1 ]; then python -c "import os; os.sched_setaffinity(0,{1})
while True: pass" & loop=$!; fi
    python -m cli bench --url http://127.0.0.1:8123 --workload sharegpt --turns 4 --max-output-tokens 128 --num-conversations 16 --tokenizer "$folder" --concurrency 2 --duration 30 --token-timing --no-progress --seed $((round*10+busy)) --out $out/r$round-w$watch-b$busy > /dev/null 2>&1
    [ $busy = 1 ] && kill $loop
    echo "round $round watch $watch busy $busy: $(python -c "import json;s=json.load(open('$out/r$round-w$watch-b$busy/summary.json'))[0];print(s['tpot_ms_p50'], s['output_tokens_per_s'])")"
  done
  kill $srv; wait $srv 2>/dev/null
done
done
