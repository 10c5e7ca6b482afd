#!/usr/bin/env bash
# Agent sessions on the CPU (issue 47, deliverable 4): SmolLM2-135M-Instruct (real weights, `--model smollm2`) under
# the `agentic` workload (coding-agent sessions: a shared prefix, dozens of turns, tool and human pauses), CONC
# sessions in flight, so that their contexts are several times the 1 GiB KV pool. Three ppd configurations and
# vLLM's CPU build (prefix caching on, its default), fresh servers in alternating rounds, every request with OpenAI's
# prompt-cache hints (prompt_cache_key, prompt_cache_retention "24h"):
#   notier: no second tier, hints off (--kv-retention-share 0)
#   tier:   a TIER_GIB second tier (file-backed, on local disk), hints off
#   hints:  the tier, and the hints kept behind the LRU (--kv-retention-share 0.25, the default)
# Usage: bench/scripts/agents_smollm2.sh OUT [ROUNDS] [CONC] [DURATION_S] [TIME_SCALE]
set -euo pipefail
out=$1 rounds=${2:-3} conc=${3:-24} duration=${4:-180} time_scale=${5:-0.25}
tier_gib=${TIER_GIB:-4}
python -m cli bench compare --policies '' --peer vllm \
  --serve-args "--model smollm2 --max-model-len 8192 --kv-cache-memory 1" \
  --variant notier="--kv-retention-share 0" \
  --variant tier="--kv-offloading-size $tier_gib --kv-retention-share 0" \
  --variant hints="--kv-offloading-size $tier_gib" \
  --workload agentic --api completions --num-conversations 200 --cache-hints --time-scale "$time_scale" \
  --concurrency "$conc" --duration "$duration" --repeat "$rounds" --no-progress --out "$out"
