"""The policy verdict report: which cells ppd wins, misses or ties, from `ppd bench compare` summaries."""

import json

from bench.policy_eval import load_runs, report


def summary(policy, qps, objective, ttft=100.0, tpot=10.0, runs=()):
    return {"label": {"server": f"ppd:{policy}", "qps": qps}, "objective_turn2plus": objective,
            "objective_w_ttft": 1, "objective_w_tpot": 10, "repeats": max(1, len(runs)),
            "ttft_turn2plus_ms_p50": ttft, "tpot_turn2plus_ms_p50": tpot,
            "runs": [{"objective_turn2plus": r} for r in runs]}


def write(folder, summaries):
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summaries))
    return folder


def test_verdicts_and_the_balanced_target(tmp_path):
    balanced = write(tmp_path / "balanced", [
        summary("pd", 2, 100.0, runs=[100, 100]), summary("dlocal", 2, 90.0, runs=[80, 100]),
        summary("ppd", 2, 80.0, runs=[70, 95]), summary("aggregated", 2, 120.0),
        summary("pd", 6, 200.0, ttft=300.0, tpot=10.0), summary("dlocal", 6, 150.0),
        summary("ppd", 6, 156.0, ttft=90.0, tpot=10.5),
    ])
    heavy = write(tmp_path / "prefill-heavy", [
        summary("pd", 2, 100.0), summary("dlocal", 2, 110.0), summary("ppd", 2, 120.0)])
    text = report(load_runs([balanced, heavy]))
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in text.splitlines()
            if line.startswith("| balanced") or line.startswith("| prefill-heavy")}
    assert rows[("balanced", "2")].endswith("| better than both |")
    assert "0.88, 0.95 (0.91)" in rows[("balanced", "2")]  # same-round ratios: 70/80, 95/100
    assert rows[("balanced", "6")].endswith("| within 5% |")  # 156 / 150 = 1.04
    assert rows[("prefill-heavy", "2")].endswith("| MISSED |")  # 120 / 100
    assert "within 5% of the better static policy: 2 of 3 cells" in text
    assert "strictly better than both pd and dlocal: 1 of 3 cells" in text
    assert "TTFT p50 is 0.30x pd's (70% lower" in text and "TPOT p50 1.05x pd's" in text
