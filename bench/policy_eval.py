"""The ppd policy against the static ones, from `ppd bench compare` runs: `python -m
bench.policy_eval DIR...`.

Each DIR is the output of one `ppd bench compare` over the policies (one workload, several loads).
For every workload and load it compares the turn-2+ objective (w_ttft * TTFT p50 + w_tpot * TPOT
p50, medians over the repeats) of ppd with the better of pd and dlocal (and, for runs made with
--interleave, the same ratio within each round, where drift of the machine's speed cancels), and
checks the issue's targets: ppd within 5% of the better static policy in every cell and strictly
better than both in at least a third of them; on the balanced workload at the highest load, turn-2+
TTFT p50 at least 60% under pd's with TPOT p50 within 10% of pd's. Prints a markdown report (and
writes it with --out). A cell where a policy measured nothing is reported as not measured; a missing
folder, summary or policy exits 2 with one line that names it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

WITHIN = 1.05
COMPARED = ("pd", "dlocal", "ppd")
MADE_BY = (
    "each is made by `bench/gpu_check.sh OUT policy-eval:W` (into OUT/policy-eval/W), or `ppd "
    "bench compare "
    "--policies pd,dlocal,ppd,aggregated --out DIR`"
)


class EvalError(Exception):
    """A folder that is not a finished comparison of the policies: printed on one line, exit code
    2."""


def load_runs(folders: list[Path]) -> dict[tuple[str, float], dict[str, dict]]:
    """(workload, load) -> policy -> median summary; an EvalError names a folder, file or policy
    that is missing."""
    if not folders:
        raise EvalError(f"no evaluation folder given: {MADE_BY}")
    cells: dict[tuple[str, float], dict[str, dict]] = {}
    for folder in folders:
        path = folder / "summary.json"
        if not folder.is_dir():
            raise EvalError(f"{folder}: no such folder, so no policy evaluation there: {MADE_BY}")
        if not path.is_file():
            raise EvalError(
                f"{path}: no such file (the comparison did not finish, or measured nothing): "
                f"{MADE_BY}"
            )
        try:
            for summary in json.loads(path.read_text()):
                label = summary["label"]
                load = label.get("qps") or label.get("concurrency")
                cells.setdefault((folder.name, load), {})[label["server"].removeprefix("ppd:")] = (
                    summary
                )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EvalError(
                f"{path}: not a summary of ppd bench compare ({exc!r}): {MADE_BY}"
            ) from exc
    if not cells:
        raise EvalError(f"{', '.join(map(str, folders))}: no runs in the summaries: {MADE_BY}")
    for (workload, load), by_policy in cells.items():
        if missing := [p for p in COMPARED if p not in by_policy]:
            raise EvalError(
                f"{workload} at load {load:g}: no run of {', '.join(missing)}: {MADE_BY}"
            )
    return cells


def paired_ratios(by_policy: dict[str, dict]) -> list[float]:
    """ppd over the better of pd and dlocal within each round (run i of each), for interleaved
    comparisons."""
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
    lines = [
        "| workload | load | pd | dlocal | ppd | aggregated | ppd / best of pd, dlocal | "
        "same-round ratios "
        "(median) | verdict |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    within = better = 0
    for (workload, load), by_policy in sorted(cells.items()):
        obj = {p: s.get("objective_turn2plus") for p, s in by_policy.items()}
        values = " | ".join(
            "-" if obj.get(p) is None else f"{obj[p]:.1f}" for p in (*COMPARED, "aggregated")
        )
        if unmeasured := [p for p in COMPARED if obj[p] is None]:
            lines.append(
                f"| {workload} | {load:g} | {values} | - | - | not measured "
                f"({', '.join(unmeasured)}) |"
            )
            continue
        best = min(obj["pd"], obj["dlocal"])
        ratio = obj["ppd"] / best
        ok = ratio <= WITHIN
        strictly = obj["ppd"] < best
        within += ok
        better += strictly
        verdict = "better than both" if strictly else ("within 5%" if ok else "MISSED")
        paired = paired_ratios(by_policy)
        rounds = ", ".join(f"{r:.2f}" for r in paired) + (
            f" ({statistics.median(paired):.2f})" if paired else ""
        )
        lines.append(
            f"| {workload} | {load:g} | {values} | {ratio:.3f} | {rounds or '-'} | {verdict} |"
        )
    n = len(cells)
    head = [
        f"Objective: w_ttft * TTFT p50 + w_tpot * TPOT p50 of turns 2+ (ms), w_ttft = "
        f"{weights['objective_w_ttft']:g}, w_tpot = {weights['objective_w_tpot']:g}; each value "
        "the median over "
        f"{weights.get('repeats', 1)} runs.",
        "",
        f"- ppd within 5% of the better static policy: {within} of {n} cells (target: all).",
        f"- ppd strictly better than both pd and dlocal: {better} of {n} cells (target: at least "
        f"{-(-n // 3)}).",
    ]
    balanced = [(load, by) for (w, load), by in cells.items() if w == "balanced"]
    if balanced:
        load, by = max(balanced, key=lambda item: item[0])
        p50 = [
            by[p].get(k)
            for p in ("ppd", "pd")
            for k in ("ttft_turn2plus_ms_p50", "tpot_turn2plus_ms_p50")
        ]
        if None in p50:
            head.append(f"- balanced at the highest load ({load:g}): not measured.")
        else:
            ttft, tpot = p50[0] / p50[2], p50[1] / p50[3]
            head.append(
                f"- balanced at the highest load ({load:g}): ppd's turn-2+ TTFT p50 is {ttft:.2f}x "
                "pd's "
                f"({1 - ttft:.0%} lower; target at least 60% lower), TPOT p50 {tpot:.2f}x pd's "
                "(target "
                "within 10%)."
            )
    return "\n".join(head + ["", *lines]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "folders",
        nargs="*",
        type=Path,
        help="ppd bench compare outputs, one per workload (its name)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        text = report(load_runs(args.folders))
    except EvalError as exc:
        print(f"python -m bench.policy_eval: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
