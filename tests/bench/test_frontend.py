"""`ppd bench frontend` over `ppd serve --stub-engine`: every stream gets all its tokens, and the
report says so."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.frontend import add_frontend_args, main


# about 18 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_frontend_bench_streams_every_token_through_the_stub_engine(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    # Enough tokens that the server's CPU time spans several clock ticks (12 tokens at 8 streams
    # once read 0).
    args = parser.parse_args(
        [
            "--streams",
            "3,8",
            "--tokens",
            "48",
            "--step-ms",
            "5",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    result = main(args)
    assert [r["streams"] for r in result["rows"]] == [3, 8]
    for row in result["rows"]:
        assert row["errors"] == row["short_streams"] == 0, row["first_error"]
        assert row["tokens_per_s"] > 0 and row["server_cpu_ms_per_1k_tokens"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == result["rows"]
    assert "| 8 |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow  # a whole run against a live server: the second suite
def test_frontend_bench_over_two_api_servers_and_two_client_processes(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    args = parser.parse_args(
        [
            "--streams",
            "16",
            "--tokens",
            "12",
            "--step-ms",
            "5",
            "--rounds",
            "1",
            "--serve-args",
            "--api-server-count 2",
            "--client-procs",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    (row,) = main(args)["rows"]
    assert row["errors"] == row["short_streams"] == 0, row["first_error"]
    assert row["api_servers"] == 2  # both processes' CPU is counted
    assert row["tokens_per_s"] > 0 and row["server_cpu_ms_per_1k_tokens"] > 0
