"""The ppd policy against the static ones, from `ppd bench compare` runs: `python -m bench.policy_eval DIR...`.

Each DIR is the output of one `ppd bench compare` over the policies (one workload, several loads). For every
workload and load it compares the turn-2+ objective (w_ttft * TTFT p50 + w_tpot * TPOT p50, medians over the
repeats) of ppd with the better of pd and dlocal (and, for runs made with --interleave, the same ratio within
each round, where drift of the machine's speed cancels), and checks the issue's targets: ppd within 5% of the better
static policy in every cell and strictly better than both in at least a third of them; on the balanced workload
at the highest load, turn-2+ TTFT p50 at least 60% under pd's with TPOT p50 within 10% of pd's. Prints a
markdown report (and writes it with --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

WITHIN = 1.05


def load_runs(folders: list[Path]) -> dict[tuple[str, float], dict[str, dict]]:
    """(workload, load) -> policy -> median summary."""
    cells: dict[tuple[str, float], dict[str, dict]] = {}
    for folder in folders:
        workload = folder.name
        for summary in json.loads((folder / "summary.json").read_text()):
            label = summary["label"]
            load = label.get("qps") or label.get("concurrency")
            policy = label["server"].removeprefix("ppd:")
            cells.setdefault((workload, load), {})[policy] = summary
    return cells


def paired_ratios(by_policy: dict[str, dict]) -> list[float]:
    """ppd over the better of pd and dlocal within each round (run i of each), for interleaved comparisons."""
    runs = {p: by_policy[p].get("runs", []) for p in ("pd", "dlocal", "ppd")}
    n = min(len(r) for r in runs.values())
    out = []
    for i in range(n):
        objs = [runs[p][i].get("objective_turn2plus") for p in ("pd", "dlocal", "ppd")]
        if None not in objs:
            out.append(objs[2] / min(objs[0], objs[1]))
    return out


def report(cells: dict[tuple[str, float], dict[str, dict]]) -> str:
    weights = next(iter(next(iter(cells.values())).values()))
    lines = ["| workload | load | pd | dlocal | ppd | aggregated | ppd / best of pd, dlocal | same-round ratios "
             "(median) | verdict |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    within = better = 0
    for (workload, load), by_policy in sorted(cells.items()):
        obj = {p: s.get("objective_turn2plus") for p, s in by_policy.items()}
        best = min(obj["pd"], obj["dlocal"])
        ratio = obj["ppd"] / best
        ok = ratio <= WITHIN
        strictly = obj["ppd"] < best
        within += ok
        better += strictly
        verdict = "better than both" if strictly else ("within 5%" if ok else "MISSED")
        values = " | ".join("-" if obj.get(p) is None else f"{obj[p]:.1f}" for p in ("pd", "dlocal", "ppd", "aggregated"))
        paired = paired_ratios(by_policy)
        rounds = ", ".join(f"{r:.2f}" for r in paired) + (f" ({statistics.median(paired):.2f})" if paired else "")
        lines.append(f"| {workload} | {load:g} | {values} | {ratio:.3f} | {rounds or '-'} | {verdict} |")
    n = len(cells)
    head = [f"Objective: w_ttft * TTFT p50 + w_tpot * TPOT p50 of turns 2+ (ms), w_ttft = "
            f"{weights['objective_w_ttft']:g}, w_tpot = {weights['objective_w_tpot']:g}; each value the median over "
            f"{weights.get('repeats', 1)} runs.", "",
            f"- ppd within 5% of the better static policy: {within} of {n} cells (target: all).",
            f"- ppd strictly better than both pd and dlocal: {better} of {n} cells (target: at least {-(-n // 3)})."]
    balanced = [(load, by) for (w, load), by in cells.items() if w == "balanced"]
    if balanced:
        load, by = max(balanced)
        ttft = by["ppd"]["ttft_turn2plus_ms_p50"] / by["pd"]["ttft_turn2plus_ms_p50"]
        tpot = by["ppd"]["tpot_turn2plus_ms_p50"] / by["pd"]["tpot_turn2plus_ms_p50"]
        head.append(f"- balanced at the highest load ({load:g}): ppd's turn-2+ TTFT p50 is {ttft:.2f}x pd's "
                    f"({1 - ttft:.0%} lower; target at least 60% lower), TPOT p50 {tpot:.2f}x pd's (target within 10%).")
    return "\n".join(head + ["", *lines]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="ppd bench compare outputs, one per workload (its name)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    text = report(load_runs(args.folders))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
