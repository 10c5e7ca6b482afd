#!/usr/bin/env bash
# Agent sessions on the CPU (issue 47, deliverable 4): SmolLM2-135M-Instruct (real weights, `--model smollm2`) under
# the `agentic` workload (coding-agent sessions: a shared prefix, dozens of turns, tool and human pauses), CONC
# sessions in flight, so that their contexts are several times the KV pool (POOL_GIB of KV, 0.5 by default: 728
# blocks of 16 tokens in float32, 11,648 tokens; vLLM's cut to the same tokens, VLLM_BLOCKS of its 128-token CPU
# blocks, with --num-gpu-blocks-override, as its CPU KV space is whole GiB). Three ppd configurations and vLLM's CPU build
# (prefix caching on, its default), fresh servers in alternating rounds, every request with OpenAI's prompt-cache
# hints (prompt_cache_key, prompt_cache_retention "24h"):
#   notier: no second tier, hints off (--kv-retention-share 0)
#   tier:   a TIER_GIB second tier (file-backed, on local disk), hints off
#   hints:  the tier, and the hints kept behind the LRU (--kv-retention-share 0.25, the default)
# The sessions' lengths are scaled by SCALE (0.05: turns of about 75 new tokens over contexts that reach 8K, where
# fitting the longest session to 8K would give 0.032), pauses stretched by TIME_SCALE (2: tool pauses about 4 s,
# human ones 50 s and more), so that 24 sessions load this 2-core CPU short of saturating it with the tier.
# Usage: bench/scripts/agents_smollm2.sh OUT [ROUNDS] [CONC] [DURATION_S] [TIME_SCALE] [SCALE]
set -euo pipefail
out=$1 rounds=${2:-3} conc=${3:-24} duration=${4:-200} time_scale=${5:-2} scale=${6:-0.05}
tier_gib=${TIER_GIB:-4} pool_gib=${POOL_GIB:-0.5} vllm_blocks=${VLLM_BLOCKS:-91}
python -m cli bench compare --policies '' --peer vllm --peer-args "--num-gpu-blocks-override $vllm_blocks" \
  --serve-args "--model smollm2 --max-model-len 8192 --kv-cache-memory $pool_gib" \
  --variant notier="--kv-retention-share 0" \
  --variant tier="--kv-offloading-size $tier_gib --kv-retention-share 0" \
  --variant hints="--kv-offloading-size $tier_gib" \
  --workload agentic --api completions --num-conversations 200 --cache-hints --time-scale "$time_scale" \
  --scale "$scale" \
  --concurrency "$conc" --duration "$duration" --repeat "$rounds" --no-progress --out "$out"
