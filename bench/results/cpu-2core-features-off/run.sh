#!/usr/bin/env bash
# Plain greedy decode-step time before (5668c37) and after the OpenAI-surface change, runs alternating in pairs.
# Each run of plain_step.py appends its median step time (ms, 400 steps) to the file it is given; the first line of
# each file is the warm-up run's. Run 2 pinned both to CPU 1 (farm-bench --pin 1).
set -euo pipefail
git worktree add -f /tmp/old-tree 5668c37
here=$(cd "$(dirname "$0")" && pwd)
farm-bench -n 12 --warmup 1 --pin 1 --timeout 560 \
  --vs "sh -c 'cd /tmp/old-tree && PYTHONPATH=/tmp/old-tree exec python $here/plain_step.py $here/run2-old.txt >/dev/null 2>&1'" \
  -- sh -c "cd $(git rev-parse --show-toplevel) && exec python $here/plain_step.py $here/run2-new.txt >/dev/null 2>&1"
git worktree remove --force /tmp/old-tree
