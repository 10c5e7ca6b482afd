"""The policy verdict report: which cells ppd wins, misses or ties, from `ppd bench compare`
summaries."""

import json
import subprocess
import sys

from bench.policy_eval import load_runs, report


def summary(policy, qps, objective, ttft=100.0, tpot=10.0, runs=()):
    return {
        "label": {"server": f"ppd:{policy}", "qps": qps},
        "objective_turn2plus": objective,
        "objective_w_ttft": 1,
        "objective_w_tpot": 10,
        "repeats": max(1, len(runs)),
        "ttft_turn2plus_ms_p50": ttft,
        "tpot_turn2plus_ms_p50": tpot,
        "runs": [{"objective_turn2plus": r} for r in runs],
    }


def write(folder, summaries):
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summaries))
    return folder


def test_verdicts_and_the_balanced_target(tmp_path):
    balanced = write(
        tmp_path / "balanced",
        [
            summary("pd", 2, 100.0, runs=[100, 100]),
            summary("dlocal", 2, 90.0, runs=[80, 100]),
            summary("ppd", 2, 80.0, runs=[70, 95]),
            summary("aggregated", 2, 120.0),
            summary("pd", 6, 200.0, ttft=300.0, tpot=10.0),
            summary("dlocal", 6, 150.0),
            summary("ppd", 6, 156.0, ttft=90.0, tpot=10.5),
        ],
    )
    heavy = write(
        tmp_path / "prefill-heavy",
        [summary("pd", 2, 100.0), summary("dlocal", 2, 110.0), summary("ppd", 2, 120.0)],
    )
    text = report(load_runs([balanced, heavy]))
    rows = {
        tuple(cell.strip() for cell in line.split("|")[1:3]): line
        for line in text.splitlines()
        if line.startswith("| balanced") or line.startswith("| prefill-heavy")
    }
    assert rows[("balanced", "2")].endswith("| better than both |")
    assert "0.88, 0.95 (0.91)" in rows[("balanced", "2")]  # same-round ratios: 70/80, 95/100
    assert rows[("balanced", "6")].endswith("| within 5% |")  # 156 / 150 = 1.04
    assert rows[("prefill-heavy", "2")].endswith("| MISSED |")  # 120 / 100
    assert "within 5% of the better static policy: 2 of 3 cells" in text
    assert "strictly better than both pd and dlocal: 1 of 3 cells" in text
    assert "TTFT p50 is 0.30x pd's (70% lower" in text and "TPOT p50 1.05x pd's" in text


def test_a_policy_that_measured_nothing_is_a_cell_not_measured(tmp_path):
    folder = write(
        tmp_path / "balanced",
        [
            summary("pd", 2, 100.0),
            summary("dlocal", 2, 90.0),
            summary("ppd", 2, None, ttft=None, tpot=None),
        ],
    )
    text = report(load_runs([folder]))
    assert "| balanced | 2 | 100.0 | 90.0 | - | - | - | - | not measured (ppd) |" in text
    assert "within 5% of the better static policy: 0 of 1 cells" in text
    assert "balanced at the highest load (2): not measured." in text


def evaluate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.policy_eval", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_missing_evaluations_are_named_with_what_makes_them(tmp_path):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "no-ppd", [summary("pd", 2, 100.0), summary("dlocal", 2, 90.0)])
    # bench/gpu_check.sh's policy-verdict step before any policy-eval step: the shell passes its
    # glob unexpanded.
    cases = [
        (
            (f"{tmp_path}/policy-eval/*/", "--out", f"{tmp_path}/policy-eval/verdict.md"),
            "policy-eval/*: ",
        ),
        ((str(tmp_path / "empty"),), "empty/summary.json: "),
        ((str(tmp_path / "no-ppd"),), "no-ppd at load 2: no run of ppd"),
        ((), "no evaluation folder given"),
    ]
    for args, named in cases:
        result = evaluate(*args)
        assert result.returncode == 2 and not result.stdout, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert (
            named in line
            and "ppd bench compare" in line
            and "gpu_check.sh OUT policy-eval:W" in line
        ), line
