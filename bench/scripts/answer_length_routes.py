"""What answer_length.sh's three servers did with the same requests: per server, turn-2+ appends
routed to the decode worker, routes equal to the truth server's for the same request, answers of
the true length, TTFT p50 and TPOT p50 of turns 2+ and the policy's objective on them (TTFT p50 +
10 x TPOT p50, its default weights), TPOT p99 of turns 2+ and ITL p99 of every answer, all taken
per round; each server's figure is the median over the rounds, and each ratio to the truth server
the median over the rounds of that round's ratio (the three servers answered the same
conversations in a round; rounds differ in theirs). Several OUT folders (answer_length.sh runs
with different SEEDs) pool their rounds. Usage: python bench/scripts/answer_length_routes.py OUT
[OUT ...]"""

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from bench.report import read_records

W_TPOT = 10  # the policy's default w_tpot / w_ttft


def key(r):
    return r["conversation"].split("#")[0], r["turn"], r["conversation"].count("#")


def p50(xs):
    return statistics.median(xs) if xs else float("nan")


def p99(xs):
    return statistics.quantiles(xs, n=100)[98] if len(xs) > 1 else float("nan")


def round_figures(records, reference, truth):
    """One run's figures; reference: the truth server's route per request of the same round."""
    ok = [r for r in records if r["error"] is None]
    later = [r for r in ok if r["turn"] > 0]
    same = [r for r in later if key(r) in reference]
    ttft = p50([r["ttft"] * 1000 for r in later])
    tpot = p50([statistics.mean(r["itl"]) * 1000 for r in later if r["itl"]])
    return {
        "requests": len(ok),
        "decode_share": sum(r["route"] == "decode" for r in later) / max(1, len(later)),
        "routes_as_truth": sum(reference[key(r)] == r["route"] for r in same) / max(1, len(same)),
        "true_length": sum(truth.get(key(r)[:2]) == r["output_tokens"] for r in ok)
        / max(1, len(ok)),
        "ttft2_p50_ms": ttft,
        "tpot2_p50_ms": tpot,
        "objective2_ms": ttft + W_TPOT * tpot,
        "tpot2_p99_ms": p99([statistics.mean(r["itl"]) * 1000 for r in later if r["itl"]]),
        "itl_p99_ms": p99([x * 1000 for r in ok for x in r["itl"]]),
    }


rounds = defaultdict(
    list
)  # server -> each round's figures, in the same round order for every server
for out in map(Path, sys.argv[1:]):
    truth = {
        (r["conversation"].split("#")[0], r["turn"]): r["output_tokens"]
        for r in read_records(out / "true-lengths.jsonl.gz")
    }
    runs = defaultdict(dict)  # server -> run number -> records
    for folder in sorted((out / "compare").glob("*-run*")):
        server, _, run = folder.name.removeprefix("ppd_").rpartition("-run")
        runs[server.rsplit("-", 1)[0]][int(run)] = read_records(folder)
    for i in sorted(runs["truth"]):
        reference = {key(r): r["route"] for r in runs["truth"][i] if r["error"] is None}
        for server in runs:
            rounds[server].append(round_figures(runs[server][i], reference, truth))

cols = [
    "requests",
    "decode_share",
    "routes_as_truth",
    "true_length",
    "ttft2_p50_ms",
    "tpot2_p50_ms",
    "objective2_ms",
    "tpot2_p99_ms",
    "itl_p99_ms",
]
ratios = ["ttft2_p50_ms", "tpot2_p50_ms", "objective2_ms", "tpot2_p99_ms", "itl_p99_ms"]
print(f"{len(rounds['truth'])} rounds\n")
print(
    "| server | "
    + " | ".join(cols)
    + " | "
    + " | ".join(f"{c.removesuffix('_ms')} / truth" for c in ratios)
    + " | objective / truth, each round |"
)
print("| --- |" + " ---: |" * (len(cols) + len(ratios)) + " --- |")
for server, figures in rounds.items():
    row = {c: statistics.median(f[c] for f in figures) for c in cols}
    per_round = {c: [f[c] / t[c] for f, t in zip(figures, rounds["truth"])] for c in ratios}
    print(
        f"| {server} | "
        + " | ".join(f"{row[c]:.3g}" for c in cols)
        + " | "
        + " | ".join(f"{statistics.median(per_round[c]):.3f}" for c in ratios)
        + " | "
        + " ".join(f"{x:.2f}" for x in per_round["objective2_ms"])
        + " |"
    )
