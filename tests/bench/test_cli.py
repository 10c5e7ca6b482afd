"""`ppd bench` and `ppd bench compare` as a user runs them: against the stub server, and against our own server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.stub_server import start_stub
from engine.demo import demo_model_path

PNG = b"\x89PNG\r\n\x1a\n"


def ppd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def stub():
    with start_stub(ttft_ms=5, itl_ms=1) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path) -> str:
    return str(demo_model_path(cache_dir))


def test_bench_writes_table_json_and_plots(stub, tokenizer: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = ppd("bench", "--url", stub.url, "--qps", "5", "--duration", "3", "--scale", "0.05", "--tokenizer", tokenizer,
                 "--goodput", "ttft:500", "tpot:100", "--out", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "| server |" in result.stdout and "TTFT turn 2+" in result.stdout
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["success_rate"] == 1.0
    assert summary["ttft_turn2plus_ms_p50"] is not None and summary["goodput_fraction"] == 1.0
    for png in ("latency_vs_qps.png", "ttft_pareto.png"):
        assert (out / png).read_bytes().startswith(PNG)
    assert (out / "report.md").read_text().count("\n| ") >= 2


def test_bench_refuses_bad_input_clearly(stub) -> None:
    no_rate = ppd("bench", "--url", stub.url)
    assert no_rate.returncode == 2 and "--qps" in no_rate.stderr
    bad_slo = ppd("bench", "--url", stub.url, "--qps", "1", "--goodput", "ttft=5")
    assert bad_slo.returncode == 2 and "ttft=5" in bad_slo.stderr
    nobody = ppd("bench", "--url", "http://127.0.0.1:9", "--qps", "1")
    assert nobody.returncode == 2 and "is the server running" in nobody.stderr


def test_ctrl_c_reports_what_was_measured(stub, tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "bench", "--url", stub.url, "--concurrency", "2",
                             "--duration", "60", "--api", "completions", "--scale", "0.05", "--out", str(out),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(6)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "interrupted" in stderr and "| server |" in stdout
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["requests"] > 0


def test_compare_our_policy_and_a_peer_with_repeats(stub, tmp_path: Path) -> None:
    out = tmp_path / "compare"
    result = ppd("bench", "compare", "--policies", "dlocal", "--server", f"stub={stub.url}", "--qps", "2,4",
                 "--duration", "3", "--repeat", "2", "--api", "completions", "--scale", "0.05",
                 "--serve-args", "--kv-cache-memory 0.1", "--out", str(out), "--no-progress", timeout=300)
    assert result.returncode == 0, result.stderr
    summaries = json.loads((out / "summary.json").read_text())
    assert [(s["label"]["server"], s["label"]["qps"]) for s in summaries] == [
        ("ppd:dlocal", 2.0), ("ppd:dlocal", 4.0), ("stub", 2.0), ("stub", 4.0)]
    assert all(s["repeats"] == 2 and len(s["runs"]) == 2 and s["success_rate"] == 1.0 for s in summaries)
    ours = summaries[0]
    # Our server: turn 1 on the prefill worker, cached turn 2 on the decode worker.
    assert set(ours["routes"]) == {"prefill", "decode"} and ours["prefix_cache_hit_fraction_turn2plus"] > 0
    assert (out / "serve-dlocal.log").exists() and (out / "latency_vs_qps.png").read_bytes().startswith(PNG)


def test_compare_interleaved_runs_each_server_once_per_round(stub, tmp_path: Path) -> None:
    out = tmp_path / "interleaved"
    result = ppd("bench", "compare", "--policies", "dlocal", "--server", f"stub={stub.url}", "--qps", "3",
                 "--duration", "2", "--repeat", "2", "--interleave", "--api", "completions", "--scale", "0.05",
                 "--serve-args", "--kv-cache-memory 0.1", "--out", str(out), "--no-progress", timeout=300)
    assert result.returncode == 0, result.stderr
    summaries = json.loads((out / "summary.json").read_text())
    assert [s["label"]["server"] for s in summaries] == ["ppd:dlocal", "stub"]
    assert all(s["repeats"] == 2 for s in summaries)
    # A fresh server per round, and each round's conversations distinct from the other's.
    assert (out / "serve-dlocal-round0.log").exists() and (out / "serve-dlocal-round1.log").exists()
    ours = [{r["conversation"] for r in map(json.loads, (out / f"ppd_dlocal-3.0-run{i}" / "records.jsonl").open())}
            for i in range(2)]
    assert ours[0] and not ours[0] & ours[1]


def test_compare_rejects_unknown_policy() -> None:
    result = ppd("bench", "compare", "--policies", "fastest")
    assert result.returncode == 2 and "fastest" in result.stderr and "aggregated" in result.stderr
