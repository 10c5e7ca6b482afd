#!/usr/bin/env bash
# Agent sessions on the CPU (issue 47, deliverable 4): SmolLM2-135M-Instruct (real weights, `--model smollm2`) under
# the `agentic` workload (coding-agent sessions: a shared prefix, dozens of turns, tool and human pauses), CONC
# sessions in flight, so that their contexts are several times the 1 GiB KV pool. Three ppd configurations and
# vLLM's CPU build (prefix caching on, its default), fresh servers in alternating rounds, every request with OpenAI's
# prompt-cache hints (prompt_cache_key, prompt_cache_retention "24h"):
#   notier: no second tier, hints off (--kv-retention-share 0)
#   tier:   a TIER_GIB second tier (file-backed, on local disk), hints off
#   hints:  the tier, and the hints kept behind the LRU (--kv-retention-share 0.25, the default)
# The sessions' lengths are scaled by SCALE (0.05: turns of about 75 new tokens over contexts that reach 8K, where
# fitting the longest session to 8K would give 0.032), pauses kept as drawn (TIME_SCALE 1).
# Usage: bench/scripts/agents_smollm2.sh OUT [ROUNDS] [CONC] [DURATION_S] [TIME_SCALE] [SCALE]
set -euo pipefail
out=$1 rounds=${2:-3} conc=${3:-20} duration=${4:-200} time_scale=${5:-1} scale=${6:-0.05}
tier_gib=${TIER_GIB:-4}
python -m cli bench compare --policies '' --peer vllm \
  --serve-args "--model smollm2 --max-model-len 8192 --kv-cache-memory 1" \
  --variant notier="--kv-retention-share 0" \
  --variant tier="--kv-offloading-size $tier_gib --kv-retention-share 0" \
  --variant hints="--kv-offloading-size $tier_gib" \
  --workload agentic --api completions --num-conversations 200 --cache-hints --time-scale "$time_scale" \
  --scale "$scale" \
  --concurrency "$conc" --duration "$duration" --repeat "$rounds" --no-progress --out "$out"
