#!/usr/bin/env bash
# Decode TPOT beside a long prefill on the 2-core CPU demo, each configuration in one run, three runs.
# Run from the repository root: bash bench/results/cpu-demo-2core-interference/run.sh
set -euo pipefail
here=bench/results/cpu-demo-2core-interference
for run in ${RUNS:-0 1 2}; do
  python -m cli bench interference --batch 8 --context 128 --prefill-tokens 1024 --rounds 5 --alone-s 3 \
    --settle-s 0.5 --out "$here/run-$run"
done
python - "$here" <<'PY'
import json, statistics, sys
from pathlib import Path
here = Path(sys.argv[1])
runs = [json.loads(p.read_text())["results"] for p in sorted(here.glob("run-*/interference.json"))]
rows = ["| config | TPOT alone (ms) | TPOT beside (ms) | ratio | prefill (ms) |", "| --- | ---: | ---: | ---: | ---: |"]
for name in runs[0]:
    ok = [r[name] for r in runs if "error" not in r[name]]
    med = lambda k: statistics.median(r[k] for r in ok)
    rows.append(f"| {name} | {med('tpot_alone_ms'):.2f} | {med('tpot_beside_ms'):.2f} | {med('ratio'):.2f} | {med('prefill_ms'):.0f} |")
(here / "medians.md").write_text(f"Medians over {len(runs)} runs\n\n" + "\n".join(rows) + "\n")
print((here / "medians.md").read_text())
PY
