"""The soak script at a small scale, against `ppd serve` (demo): random sampling parameters, some
requests abandoned; nothing lost, no unexpected error, the server idle once the clients have
gone."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import report, run


@pytest.mark.slow
def test_a_short_soak_loses_nothing(start_server) -> None:
    server = start_server("--policy", "ppd")
    args = argparse.Namespace(
        requests=80,
        concurrency=8,
        abort_fraction=0.2,
        timeout=120.0,
        sample_every=20,
        seed=3,
        api_key=None,
        no_progress=True,
    )
    result = asyncio.run(run(args, server.url))
    outcomes = result["outcomes"]
    assert outcomes.get("lost", 0) == 0 and outcomes.get("unexpected", 0) == 0, result["problems"]
    assert outcomes.get("ok", 0) >= 40 and outcomes.get("aborted", 0) >= 1
    assert (
        result["seconds_to_idle_after_last_client"] is not None and result["worker_pids_unchanged"]
    )
    assert "lost: 0; unexpected errors: 0" in report(result, "python -m bench.soak")


def test_the_server_it_starts_logs_in_its_output_folder(tmp_path: Path) -> None:
    # No --out and no $PPD_RESULTS_DIR: the default folder, ppd-results/soak-<time> under the
    # working directory.
    env = {k: v for k, v in os.environ.items() if k != "PPD_RESULTS_DIR"}
    result = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--serve-args=--no-such-flag", "--requests", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (log,) = tmp_path.glob("ppd-results/soak-*/serve.log")
    assert f"results go to {log.parent.relative_to(tmp_path)}" in result.stderr
    assert "unrecognized arguments: --no-such-flag" in log.read_text()
