"""`ppd bench interference`: the TPOT of a window, the configurations chosen, and one real run on the demo model
(two streams beside two short prompts) that leaves a table and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import BenchError
from bench.interference import _tpot
from server.cli import main


def test_a_windows_tpot_counts_every_streams_tokens_in_it() -> None:
    # Two streams over [0, 1): one gets 10 tokens, the other 0 (stalled); 10 tokens for 2 streams in 1 s: 200 ms.
    arrivals = [[0.05 + 0.1 * i for i in range(10)] + [1.5], []]
    assert _tpot(arrivals, 0.0, 1.0) == pytest.approx(200.0)
    assert _tpot([[], []], 0.0, 1.0) == float("inf")


def test_an_unknown_configuration_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "interference", "--only", "aggregated,green", "--serve-args", "--device cpu",
                 "--out", str(tmp_path)]) == 2
    assert "no configuration 'green'" in capsys.readouterr().err


def test_a_configuration_that_measured_nothing_fails_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "interference", "--config", "broken=--no-such-flag", "--out", str(tmp_path)]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("not measured:")]
    assert line.startswith("not measured: broken: ") and "unrecognized arguments: --no-such-flag" in line
    assert "error" in json.loads((tmp_path / "interference.json").read_text())["results"]["broken"]
    assert (tmp_path / "broken.log").exists()


@pytest.mark.slow  # a whole run against a live server: the second suite
def test_one_configuration_on_the_demo_model(tmp_path: Path) -> None:
    assert main(["bench", "interference", "--config", "thread=--policy pd --partition none --prefill-worker thread",
                 "--batch", "2", "--context", "16", "--prefill-tokens", "200", "--rounds", "2", "--alone-s", "0.5",
                 "--settle-s", "0.2", "--out", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "interference.json").read_text())
    result = found["results"]["thread"]
    assert "error" not in result, result
    assert len(result["tpot_beside_each_ms"]) == 2 and len(result["prefill_each_ms"]) == 2
    assert 0 < result["tpot_alone_ms"] < float("inf") and result["ratio"] > 0
    assert "| thread |" in (tmp_path / "interference.md").read_text()


def test_results_are_written_after_each_configuration_and_kept_for_a_later_run(tmp_path: Path) -> None:
    """A run stopped by a time limit keeps the configurations it measured: the table is rewritten after each one,
    and a later run with the same settings (bench/gpu_check.sh's next device call, interference:NAMES) adds to it."""
    sizes = ["--batch", "2", "--context", "16", "--prefill-tokens", "200", "--rounds", "1", "--alone-s", "0.3",
             "--settle-s", "0.1"]
    settings = {"batch": 2, "context": 16, "prefill_tokens": 200, "rounds": 1, "alone_s": 0.3, "settle_s": 0.1}
    measured = {"serve_args": ["--policy", "pd"], "tpot_alone_ms": 10.0, "tpot_beside_ms": 12.0, "ratio": 1.2,
                "tpot_beside_each_ms": [12.0], "prefill_each_ms": [300.0], "prefill_ms": 300.0}
    (tmp_path / "interference.json").write_text(json.dumps({"settings": settings, "results": {"thread": measured}}))
    assert main(["bench", "interference", "--config", "other=--nope", *sizes, "--out", str(tmp_path)]) == 1
    found = json.loads((tmp_path / "interference.json").read_text())["results"]
    assert found["thread"] == measured and "error" in found["other"]
    assert "| thread |" in (tmp_path / "interference.md").read_text()
    # Other settings start a new table.
    assert main(["bench", "interference", "--config", "other=--nope", *sizes[:-2], "--settle-s", "0.2",
                 "--out", str(tmp_path)]) == 1
    assert set(json.loads((tmp_path / "interference.json").read_text())["results"]) == {"other"}
