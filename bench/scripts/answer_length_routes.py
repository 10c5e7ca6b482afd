"""What answer_length.sh's three servers did with the same requests: per server (medians over rounds), turn-2+ requests routed
to the decode worker, routes equal to the truth server's for the same request, answers of the true length, TTFT
turn 2+ p50 and TPOT p50 (from each run's records), and each as a ratio to the truth server's. Usage: python bench/scripts/answer_length_routes.py OUT"""

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from bench.report import read_records

out = Path(sys.argv[1])
truth = {}
for r in read_records(out / "true-lengths.jsonl.gz"):
    truth[(r["conversation"].split("#")[0], r["turn"])] = r["output_tokens"]
runs = defaultdict(list)  # server -> [records of a run]
for folder in sorted((out / "compare").glob("*-run*")):
    server = folder.name.rsplit("-", 2)[0].removeprefix("ppd_")
    runs[server].append(read_records(folder))


def key(r):
    return r["conversation"].split("#")[0], r["turn"], r["conversation"].count("#")


def p50(xs):
    return statistics.median(xs) if xs else float("nan")


rows = {}
for server, recs in runs.items():
    per_run = []
    for i, records in enumerate(recs):
        ok = [r for r in records if r["error"] is None]
        later = [r for r in ok if r["turn"] > 0]
        reference = {key(r): r["route"] for r in runs["truth"][i] if r["error"] is None} if "truth" in runs else {}
        same = [r for r in later if key(r) in reference]
        tpots = [statistics.mean(r["itl"]) * 1000 for r in ok if r["itl"]]
        per_run.append({
            "requests": len(ok),
            "decode_share": sum(r["route"] == "decode" for r in later) / max(1, len(later)),
            "routes_as_truth": sum(reference[key(r)] == r["route"] for r in same) / max(1, len(same)),
            "true_length": sum(truth.get(key(r)[:2]) == r["output_tokens"] for r in ok) / max(1, len(ok)),
            "ttft2_p50_ms": p50([r["ttft"] * 1000 for r in later]),
            "tpot_p50_ms": p50(tpots),
        })
    rows[server] = {k: statistics.median(run[k] for run in per_run) for k in per_run[0]}
cols = ["requests", "decode_share", "routes_as_truth", "true_length", "ttft2_p50_ms", "tpot_p50_ms"]
print("| server | " + " | ".join(cols) + " | TTFT 2+ / truth | TPOT / truth |")
print("| --- |" + " ---: |" * (len(cols) + 2))
for server, row in rows.items():
    ref = rows.get("truth", row)
    print(f"| {server} | " + " | ".join(f"{row[c]:.3g}" for c in cols)
          + f" | {row['ttft2_p50_ms'] / ref['ttft2_p50_ms']:.2f} | {row['tpot_p50_ms'] / ref['tpot_p50_ms']:.2f} |")
