#!/usr/bin/env bash
# The ppd policy's answer-length estimate against the true lengths and against reading the cap (issue 35,
# deliverable 3): SmolLM2-135M-Instruct in bfloat16 (--dtype auto here), ShareGPT conversations of 4 turns, greedy,
# requests sent WITHOUT max_tokens (answers end where the model ends them, or at the 1,024-token context: this small
# model's greedy answers often repeat until the context is full), the ppd policy (a core for each worker on this
# 2-core machine).
#   estimate: ppd serve as it is (the policy is given the estimate; max_tokens, absent, is the remaining context)
#   cap:      --answer-length max-tokens: the policy reads max_tokens (here the remaining context) as the length
#   truth:    --answer-length max-tokens, and each request sends max_tokens = its true answer length, recorded by
#             a first run of the same conversations: the policy is told the truth (greedy answers repeat run to run
#             but for bfloat16 near-ties under another batch: answer_length_routes.py says how many had the recorded length)
# Usage: [CONTEXT=1024] [PASTE=0] [TURNS=4] [DTYPE=auto] [SEED=0] bench/scripts/answer_length.sh OUT [ROUNDS]   (from the
# repository root; PASTE=N: every later turn carries a passage of about N tokens of real text and asks for one
# sentence, --paste-tokens; DTYPE=float32: answers that repeat from run to run, where bfloat16's near-ties flip;
# SEED=N: round r's conversations are seed N + r, so SEED=3 after 3 rounds at SEED=0 adds 3 new rounds)
set -euo pipefail
out=$1 rounds=${2:-2} context=${CONTEXT:-1024} paste=${PASTE:-0} turns=${TURNS:-4} dtype=${DTYPE:-auto} seed=${SEED:-0}
folder=$(python -c "from engine.gguf import model_folder, smollm2_gguf; print(model_folder(smollm2_gguf()))")
common=(--serve-args "--model smollm2 --dtype $dtype --policy ppd --max-model-len $context --kv-cache-memory 2"
        --workload sharegpt --turns "$turns" --paste-tokens "$paste" --max-output-tokens 256 --num-conversations 24
        --tokenizer "$folder"
        --concurrency 8 --duration 90 --token-timing --no-progress --max-tokens-from none --seed "$seed")
# 1. The true lengths: the same conversations (each round's seed), answered once.
python -m cli bench compare --policies ppd "${common[@]}" --repeat "$rounds" --out "$out/lengths"
cat "$out"/lengths/ppd_ppd-8-run*/records.jsonl.gz > "$out/true-lengths.jsonl.gz"  # gzip members concatenate
# 2. The three side by side, a fresh server each round, in turns.
python -m cli bench compare --policies ppd --variant "cap=--answer-length max-tokens" \
  --variant "truth=--answer-length max-tokens -- --max-tokens-from $out/true-lengths.jsonl.gz" \
  "${common[@]}" --repeat "$rounds" --interleave --out "$out/compare"
python bench/scripts/answer_length_routes.py "$out"
