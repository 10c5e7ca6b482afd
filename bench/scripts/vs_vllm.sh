#!/usr/bin/env bash
# ppd serve (its default policy, and aggregated) beside vLLM's CPU build, on the issue-23 model and workload:
# a random-weight Llama (hidden 1024, 8 layers, 16 heads, 8 KV heads, head_dim 64, intermediate 2816, bf16, the
# demo's byte-level tokenizer) written by bench/scripts/vs_vllm_model.py, 24 conversations of
# TURNS turns, 200-400 new user tokens a turn, 64-token answers, 8 in flight, fresh servers in alternating rounds;
# 2 GiB of KV cache each (vLLM: VLLM_CPU_KVCACHE_SPACE=2), enough for every conversation's history.
# Usage: [POLICIES=aggregated] bench/scripts/vs_vllm.sh MODEL_FOLDER OUT TURNS [ROUNDS]
# (POLICIES: ppd's policies to run, default ppd,aggregated; aggregated alone is the 2-core default and halves the time)
set -euo pipefail
model=$1 out=$2 turns=$3 rounds=${4:-3} policies=${POLICIES:-ppd,aggregated}
python -m cli bench compare --policies "$policies" --peer vllm \
  --serve-args "--model $model --dtype bfloat16 --max-model-len 8192 --kv-cache-memory 2" \
  --workload uniform --turns "$turns" --user-tokens 200-400 --output-tokens 64 --num-conversations 24 \
  --concurrency 8 --duration 60 --repeat "$rounds" --token-timing --no-progress --out "$out"
