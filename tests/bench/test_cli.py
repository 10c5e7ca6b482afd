"""`ppd bench` and `ppd bench compare` as a user runs them: against the stub server, and against our
own server."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.cli import _tokenizer_folder
from bench.common import BenchError
from bench.report import read_records
from bench.stub_server import start_stub
from engine.demo import demo_model_path

PNG = b"\x89PNG\r\n\x1a\n"


def ppd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def stub():
    with start_stub(ttft_ms=5, itl_ms=1) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path) -> str:
    return str(demo_model_path(cache_dir))


# about 16 s on 2 cores: in the second suite, which keeps the default one under 10 minutes
@pytest.mark.slow
def test_bench_writes_table_json_and_plots(stub, tokenizer: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = ppd(
        "bench",
        "--url",
        stub.url,
        "--qps",
        "5",
        "--duration",
        "3",
        "--scale",
        "0.05",
        "--tokenizer",
        tokenizer,
        "--goodput",
        "ttft:500",
        "tpot:100",
        "--out",
        str(out),
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    assert "| server |" in result.stdout and "TTFT turn 2+" in result.stdout
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["success_rate"] == 1.0
    assert summary["ttft_turn2plus_ms_p50"] is not None and summary["goodput_fraction"] == 1.0
    # one load: the table says it all, and no plot of a single point is drawn
    assert not list(out.glob("*.png"))
    assert (out / "report.md").read_text().count("\n| ") >= 2


def test_results_go_under_ppd_results_dir_else_ppd_results(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from bench.common import default_out

    monkeypatch.delenv("PPD_RESULTS_DIR", raising=False)
    assert Path(default_out("bench")).parent == Path(
        "ppd-results"
    )  # in the working folder, not in the package
    monkeypatch.setenv("PPD_RESULTS_DIR", str(tmp_path))
    out = Path(default_out("compare"))
    assert out.parent == tmp_path and out.name.startswith("compare-20")


def test_bench_without_out_says_its_results_folder_at_the_start_and_the_end(
    stub, tmp_path: Path
) -> None:
    # Token ids, no tokenizer: the stub has no /tokenize, and a completions run needs none.
    env = {**os.environ, "PPD_RESULTS_DIR": str(tmp_path / "results")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "bench",
            "--url",
            stub.url,
            "--qps",
            "5",
            "--duration",
            "1",
            "--scale",
            "0.05",
            "--api",
            "completions",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    (out,) = (tmp_path / "results").glob("bench-*")
    assert (out / "summary.json").is_file()
    lines = result.stderr.splitlines()
    assert f"results go to {out}" in lines[:3] and lines[-1] == f"written to {out}"


def test_bench_refuses_bad_input_clearly(stub, capsys: pytest.CaptureFixture) -> None:
    code, err = ppd_here(capsys, "bench", "--url", stub.url)
    assert code == 2 and "--qps" in err
    code, err = ppd_here(capsys, "bench", "--url", stub.url, "--qps", "1", "--goodput", "ttft=5")
    assert code == 2 and "ttft=5" in err
    code, err = ppd_here(capsys, "bench", "--url", "http://127.0.0.1:9", "--qps", "1")
    assert code == 2 and "is the server running" in err


def ppd_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`ppd ARGS` in this process (no interpreter and torch to start): its exit code and stderr."""
    from cli.main import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    return code, capsys.readouterr().err


def test_bench_replays_the_shipped_agentic_trace_with_cache_hints(
    stub, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trace = Path(__file__).parents[2] / "bench" / "data" / "agentic_seed0.jsonl"
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    out = tmp_path / "replay"
    httpx.post(f"{stub.url}/stub/reset", timeout=10)
    code, err = ppd_here(
        capsys,
        "bench",
        "--url",
        stub.url,
        "--api",
        "completions",
        "--workload",
        f"trace:{trace}",
        "--replay",
        "--time-scale",
        "0.002",
        "--cache-hints",
        "--duration",
        "60",
        "--out",
        str(out),
        "--no-progress",
    )
    assert code == 0, err
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["label"]["replay"] is True and summary["label"]["time_scale"] == 0.002
    # Every turn of every session, once, then the run ended.
    assert summary["requests"] == summary["succeeded"] == len(lines)
    assert summary["conversations"] == len({line["session_id"] for line in lines})
    assert sum(summary["turn2plus_requests_by_context"].values()) == len(lines) - 4
    assert summary["recomputed_fraction_turn2plus"] == 1.0  # the stub caches nothing of them
    bodies = [entry["body"] for entry in httpx.get(f"{stub.url}/stub/log", timeout=10).json()]
    assert {b["prompt_cache_key"] for b in bodies} == {line["session_id"] for line in lines}
    assert all(b["prompt_cache_retention"] == "24h" and b["ignore_eos"] for b in bodies)
    assert sorted(b["max_tokens"] for b in bodies) == sorted(x["output_length"] for x in lines)
    firsts = [b["prompt"] for b in bodies if len(b["prompt"]) == lines[0]["input_length"]]
    assert firsts and all(p[:512] == firsts[0][:512] for p in firsts), "the shared prefix"


def test_bench_refuses_traces_without_token_ids_or_a_trace_to_replay(
    stub, capsys: pytest.CaptureFixture
) -> None:
    url = ("--url", stub.url)
    code, err = ppd_here(capsys, "bench", *url, "--concurrency", "1", "--workload", "agentic")
    assert code == 2 and "pass --api completions" in err
    code, err = ppd_here(capsys, "bench", *url, "--replay", "--api", "completions")
    assert code == 2 and "--workload trace:FILE or agentic" in err
    code, err = ppd_here(
        capsys, "bench", *url, "--qps", "1", "--api", "completions", "--workload", "trace:/x"
    )
    assert code == 2 and "cannot read the trace /x" in err
    code, err = ppd_here(capsys, "bench", *url, "--qps", "1", "--workload", "trace:")
    assert code == 2 and "choose from synthetic" in err


# about 10 s on 2 cores: in the second suite, which keeps the default one under 10 minutes
@pytest.mark.slow
def test_ctrl_c_reports_what_was_measured(stub, tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    httpx.post(f"{stub.url}/stub/reset", timeout=10)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "bench",
            "--url",
            stub.url,
            "--concurrency",
            "2",
            "--duration",
            "60",
            "--api",
            "completions",
            "--scale",
            "0.05",
            "--out",
            str(out),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started in the background (`pytest &`) ignores SIGINT, and so would the child,
        # whose Python then never raises KeyboardInterrupt: give it a terminal's default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Ctrl-C once a third request reached the stub: one of the two slots has finished a request and
    # recorded it.
    deadline = time.monotonic() + 120
    while len(httpx.get(f"{stub.url}/stub/log", timeout=10).json()) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, (
            "the bench sent no second request"
        )
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "interrupted" in stderr and "| server |" in stdout
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["requests"] > 0


@pytest.mark.slow
def test_compare_our_policy_and_a_peer_with_repeats(stub, tmp_path: Path) -> None:
    out = tmp_path / "compare"
    result = ppd(
        "bench",
        "compare",
        "--policies",
        "dlocal",
        "--server",
        f"stub={stub.url}",
        "--qps",
        "2,4",
        "--duration",
        "3",
        "--repeat",
        "2",
        "--api",
        "completions",
        "--scale",
        "0.05",
        "--serve-args",
        "--kv-cache-memory 0.1",
        "--out",
        str(out),
        "--no-progress",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summaries = json.loads((out / "summary.json").read_text())
    assert [(s["label"]["server"], s["label"]["qps"]) for s in summaries] == [
        ("ppd:dlocal", 2.0),
        ("ppd:dlocal", 4.0),
        ("stub", 2.0),
        ("stub", 4.0),
    ]
    assert all(
        s["repeats"] == 2 and len(s["runs"]) == 2 and s["success_rate"] == 1.0 for s in summaries
    )
    ours = summaries[0]
    # Our server: turn 1 on the prefill worker, cached turn 2 on the decode worker.
    assert (
        set(ours["routes"]) == {"prefill", "decode"}
        and ours["prefix_cache_hit_fraction_turn2plus"] > 0
    )
    assert (out / "serve-dlocal.log").exists() and (
        out / "latency_vs_qps.png"
    ).read_bytes().startswith(PNG)


@pytest.mark.slow
def test_compare_interleaved_runs_each_server_once_per_round(stub, tmp_path: Path) -> None:
    out = tmp_path / "interleaved"
    result = ppd(
        "bench",
        "compare",
        "--policies",
        "dlocal",
        "--server",
        f"stub={stub.url}",
        "--qps",
        "3",
        "--duration",
        "2",
        "--repeat",
        "2",
        "--interleave",
        "--api",
        "completions",
        "--scale",
        "0.05",
        "--serve-args",
        "--kv-cache-memory 0.1",
        "--out",
        str(out),
        "--no-progress",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summaries = json.loads((out / "summary.json").read_text())
    assert [s["label"]["server"] for s in summaries] == ["ppd:dlocal", "stub"]
    assert all(s["repeats"] == 2 for s in summaries)
    # A fresh server per round, and each round's conversations distinct from the other's.
    assert (out / "serve-dlocal-round0.log").exists() and (out / "serve-dlocal-round1.log").exists()
    ours = [
        {
            r["conversation"]
            for r in read_records(out / f"ppd_dlocal-3.0-run{i}" / "records.jsonl.gz")
        }
        for i in range(2)
    ]
    assert ours[0] and not ours[0] & ours[1]


# about 13 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_compare_refuses_chat_without_a_tokenizer_before_starting_a_server(
    weights_only: Path, tmp_path: Path
) -> None:
    # As bench/gpu_check.sh serves a configuration with dummy weights: its folder has no tokenizer
    # files.
    for serve_args, fix in (
        (f"--model {weights_only} --skip-tokenizer-init", "token ids only: pass --api completions"),
        (f"--model {weights_only}", "pass --api completions (token ids) or --tokenizer PATH"),
    ):
        out = tmp_path / str(len(serve_args))
        result = ppd(
            "bench",
            "compare",
            "--policies",
            "dlocal",
            "--serve-args",
            serve_args,
            "--api",
            "chat",
            "--qps",
            "1",
            "--duration",
            "1",
            "--out",
            str(out),
            "--no-progress",
        )
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert fix in line
        assert not list(out.glob("serve-*.log"))  # no server was started


@pytest.mark.slow  # a whole run against a live server: the second suite
def test_compare_measures_servers_without_a_tokenizer_on_token_ids(
    weights_only: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ids"
    result = ppd(
        "bench",
        "compare",
        "--policies",
        "dlocal",
        "--api",
        "completions",
        "--qps",
        "2",
        "--duration",
        "2",
        "--scale",
        "0.05",
        "--num-conversations",
        "4",
        "--out",
        str(out),
        "--no-progress",
        "--serve-args",
        f"--model {weights_only} --skip-tokenizer-init --kv-cache-memory 0.1",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["succeeded"] > 0 and summary["success_rate"] == 1.0
    # The server's host costs over the run, from its own counters: every step timed, the loop around
    # it and the API server's CPU per token both some time.
    assert summary["engine_step_ms"] > 0 and summary["worker_loop_ms_per_step"] > 0
    assert 0 < summary["worker_loop_share"] < 1 and summary["api_cpu_us_per_token"] > 0
    assert "Host costs of the ppd servers" in (out / "report.md").read_text()


def test_the_tokenizer_comes_only_from_a_folder_that_has_one(
    weights_only: Path, tokenizer: str
) -> None:
    def folder(
        serve_args: str = "", served: dict | None = None, given: str | None = None
    ) -> str | None:
        return _tokenizer_folder(argparse.Namespace(tokenizer=given, serve_args=serve_args), served)

    assert folder(f"--model {tokenizer}") == tokenizer
    assert folder(f"--model {weights_only}") is None
    assert folder(f"--model {tokenizer} --skip-tokenizer-init") is None
    assert folder(f"--model {weights_only} --tokenizer {tokenizer}") == tokenizer
    assert folder(served={"id": "m", "root": str(weights_only)}) is None
    assert folder(served={"id": "m", "root": tokenizer}) == tokenizer
    with pytest.raises(BenchError, match="--tokenizer .*: no tokenizer files"):
        folder(given=str(weights_only))


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
def test_compare_that_measured_nothing_says_what_and_fails(stub, tmp_path: Path) -> None:
    # Every request past a 1 ms timeout: the stub answers after 5 ms.
    timed_out = ppd(
        "bench",
        "compare",
        "--policies",
        "",
        "--server",
        f"stub={stub.url}",
        "--qps",
        "2",
        "--duration",
        "2",
        "--api",
        "completions",
        "--scale",
        "0.05",
        "--timeout",
        "0.001",
        "--out",
        str(tmp_path / "timeout"),
        "--no-progress",
    )
    assert timed_out.returncode == 1, timed_out.stderr
    assert "not measured: stub at 2: " in timed_out.stderr and "timeout" in timed_out.stderr
    # A server that does not start: the others are still measured and reported.
    broken = ppd(
        "bench",
        "compare",
        "--policies",
        "dlocal",
        "--server",
        f"stub={stub.url}",
        "--serve-args=--no-such-flag",
        "--qps",
        "2",
        "--duration",
        "2",
        "--api",
        "completions",
        "--scale",
        "0.05",
        "--out",
        str(tmp_path / "broken"),
        "--no-progress",
    )
    assert broken.returncode == 1, broken.stderr
    (line,) = [line for line in broken.stderr.splitlines() if line.startswith("not measured:")]
    assert (
        line.startswith("not measured: ppd:dlocal at 2: ")
        and "unrecognized arguments: --no-such-flag" in line
    )
    (summary,) = json.loads((tmp_path / "broken" / "summary.json").read_text())
    assert summary["label"]["server"] == "stub" and summary["success_rate"] == 1.0


@pytest.mark.slow
def test_compare_runs_our_server_under_each_variants_settings(tmp_path: Path) -> None:
    """--variant NAME=ARGS: our server started with those arguments after --serve-args, reported as
    ppd:NAME."""
    out = tmp_path / "variants"
    result = ppd(
        "bench",
        "compare",
        "--policies",
        "",
        "--variant",
        "blocks16=--block-size 16",
        "--variant",
        "blocks32=--policy aggregated --block-size 32",
        "--qps",
        "2",
        "--duration",
        "2",
        "--api",
        "completions",
        "--scale",
        "0.05",
        "--serve-args",
        "--kv-cache-memory 0.1",
        "--out",
        str(out),
        "--no-progress",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summaries = json.loads((out / "summary.json").read_text())
    assert [s["label"]["server"] for s in summaries] == ["ppd:blocks16", "ppd:blocks32"]
    assert all(s["success_rate"] == 1.0 for s in summaries)
    assert "blocks of 16 tokens" in (out / "serve-blocks16.log").read_text()
    blocks32 = (out / "serve-blocks32.log").read_text()
    assert "blocks of 32 tokens" in blocks32 and "policy aggregated" in blocks32


@pytest.mark.parametrize("variant", ["nothing", "=--block-size 32", "dlocal=--block-size 32"])
def test_compare_refuses_a_variant_without_its_own_name(
    variant: str, capsys: pytest.CaptureFixture
) -> None:
    code, err = ppd_here(capsys, "bench", "compare", "--policies", "dlocal", "--variant", variant)
    assert code != 0 and "--variant" in err and "NAME=ARGS" in err


def test_compare_rejects_unknown_policy(capsys: pytest.CaptureFixture) -> None:
    code, err = ppd_here(capsys, "bench", "compare", "--policies", "fastest")
    assert code == 2 and "fastest" in err and "aggregated" in err


@pytest.mark.slow  # a server of its own (about 15 s on 2 cores): the second suite
def test_serve_args_with_a_port_are_polled_on_that_port(tmp_path) -> None:
    import socket

    from bench.servers import start_server, stop_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, url = start_server(["--port", str(port), "--policy", "dlocal"], tmp_path / "serve.log")
    try:
        assert url == f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_bench_against_the_demo_fits_its_context_and_shows_failures(
    start_server, cache_dir: Path, tmp_path: Path
) -> None:
    import os

    server = start_server("--max-model-len", "512", "--policy", "dlocal")
    env = {**os.environ, "PPD_CACHE_DIR": str(cache_dir)}

    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "cli",
                "bench",
                "--url",
                server.url,
                "--qps",
                "2",
                "--duration",
                "3",
                "--num-conversations",
                "6",
                "--no-progress",
                "--out",
                str(tmp_path / f"run{len(args)}"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )

    # As the README runs it: no --tokenizer (the demo's is found), no --scale (fitted to the
    # 512-token context).
    fitted = bench()
    assert fitted.returncode == 0, fitted.stderr
    assert "fitting the workload to the server's context (512 tokens)" in fitted.stderr
    assert "requests failed" not in fitted.stderr
    # Too long on purpose: the reason is on screen, not only in summary.json.
    too_long = bench("--scale", "1")
    assert (
        "requests failed" in too_long.stderr and "maximum context length is 512" in too_long.stderr
    )


def test_max_tokens_from_none_a_records_file_or_the_workload(tmp_path: Path) -> None:
    """--max-tokens-from: the workload's budgets, none (sent without max_tokens), or each turn's
    recorded answer length from an earlier run's records (a cycled conversation's records count for
    it)."""
    from bench.cli import _budgets, _variant_args
    from bench.client import Conversation, Turn, _budget

    def conversations() -> list[Conversation]:
        return [
            Conversation("a", [Turn("hi", 100), Turn("more", 100)]),
            Conversation("b", [Turn("yo", 50)]),
        ]

    assert [[t.max_tokens for t in c.turns] for c in _budgets(conversations(), "workload")] == [
        [100, 100],
        [50],
    ]
    none = _budgets(conversations(), "none")
    assert [[t.max_tokens for t in c.turns] for c in none] == [[None, None], [None]]
    assert _budget("max_tokens", none[0].turns[0]) == {} and _budget(
        "max_tokens", Turn("x", 7)
    ) == {"max_tokens": 7}
    records = tmp_path / "records.jsonl"
    rows = [
        {"conversation": "a", "turn": 0, "output_tokens": 31, "error": None},
        {"conversation": "a#2", "turn": 1, "output_tokens": 12, "error": None},
        {"conversation": "b", "turn": 0, "output_tokens": 0, "error": "timeout"},
    ]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    told = _budgets(conversations(), str(records))
    assert [[t.max_tokens for t in c.turns] for c in told] == [[31, 12], [None]], (
        "unrecorded: no max_tokens"
    )
    packed = (
        tmp_path / "run" / "records.jsonl.gz"
    )  # what ppd bench writes: the run's folder or its file
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(records.read_bytes()))
    for source in (packed, packed.parent):
        assert [
            [t.max_tokens for t in c.turns] for c in _budgets(conversations(), str(source))
        ] == [[31, 12], [None]]
    with pytest.raises(BenchError, match="--max-tokens-from"):
        _budgets(conversations(), str(tmp_path / "missing.jsonl"))
    assert _variant_args("t", ["--policy", "ppd", "--", "--max-tokens-from", "x.jsonl"]) == (
        ["--policy", "ppd"],
        "x.jsonl",
    )
    assert _variant_args("t", ["--policy", "ppd"]) == (["--policy", "ppd"], None)
    with pytest.raises(BenchError, match="only --max-tokens-from"):
        _variant_args("t", ["--policy", "ppd", "--", "--qps", "3"])
