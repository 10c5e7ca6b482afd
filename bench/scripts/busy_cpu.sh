#!/usr/bin/env bash
# ppd serve beside vLLM's CPU build with one core taken by a busy loop, against both alone (issue 50,
# deliverable 4): SmolLM2-135M-Instruct (`--model smollm2`, the folder ppd converts its GGUF into, given to
# vLLM too), ShareGPT conversations of 4 turns, 2 in flight, greedy, answers ending where the model ends
# them; fresh servers in alternating rounds. The busy loop (`--busy-cores 1`) is a process spinning on the
# machine's last core while each load runs, started after the server is up.
# Usage: bench/scripts/busy_cpu.sh OUT [ROUNDS] [DURATION_S]
set -euo pipefail
out=$1 rounds=${2:-2} duration=${3:-40}
folder=$(python -c "from engine.gguf import model_folder, smollm2_gguf; print(model_folder(smollm2_gguf()))")
for busy in 0 1; do
  python -m cli bench compare --policies aggregated --peer vllm \
    --serve-args "--model smollm2 --max-model-len 8192 --kv-cache-memory 2" \
    --workload sharegpt --turns 4 --max-output-tokens 256 --num-conversations 16 --tokenizer "$folder" \
    --concurrency 2 --duration "$duration" --repeat "$rounds" --token-timing --no-progress \
    --busy-cores "$busy" --out "$out/busy$busy"
done
