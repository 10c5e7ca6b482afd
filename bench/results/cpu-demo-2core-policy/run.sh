#!/usr/bin/env bash
# The ppd policy against pd, dlocal and aggregated on the CPU demo model (2 cores), as committed here.
# From the repository root: bash bench/results/cpu-demo-2core-policy/run.sh
set -euo pipefail
out=bench/results/cpu-demo-2core-policy
# The table the ppd policy reads (profiles/cpu-2core__demo-v1__policy.json), made first, on a quiet machine.
[ -f profiles/cpu-2core__demo-v1__policy.json ] || python -m cli profile policy --repeat 2 --no-progress
for workload in decode-heavy balanced prefill-heavy; do
  python -m cli bench compare --policies pd,dlocal,ppd,aggregated --profile "$workload" --turn1 mixed \
    --scale 0.125 --qps 2,4,6 --duration 20 --repeat 3 --interleave --num-conversations 300 --no-progress --out "$out/$workload"
done
python -m bench.policy_eval "$out/decode-heavy" "$out/balanced" "$out/prefill-heavy" --out "$out/verdict.md"
