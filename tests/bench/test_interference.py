"""`ppd bench interference`: the TPOT of a window, the configurations chosen, and one real run on
the demo model (two streams beside two short prompts) that leaves a table and its JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench import interference
from bench.common import BenchError
from bench.interference import GPU_CONFIGS, GPU_DEFAULT, Shares, _tpot, configurations, report
from cli.main import main


def test_a_windows_tpot_counts_every_streams_tokens_in_it() -> None:
    # Two streams over [0, 1): one gets 10 tokens, the other 0 (stalled); 10 tokens for 2 streams in
    # 1 s: 200 ms.
    arrivals = [[0.05 + 0.1 * i for i in range(10)] + [1.5], []]
    assert _tpot(arrivals, 0.0, 1.0) == pytest.approx(200.0)
    assert _tpot([[], []], 0.0, 1.0) == float("inf")


def test_an_unknown_configuration_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "bench",
                "interference",
                "--only",
                "aggregated,green",
                "--serve-args",
                "--device cpu",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert (
        "no configuration 'green' (there are aggregated, none, cpu, thread)"
        in capsys.readouterr().err
    )
    with pytest.raises(
        BenchError,
        match="no configuration 'green-static-32' \\(there are aggregated, none, mps, "
        "green, green-static-64, green-static-96, mps-40, green-static-96-smtarget, "
        "green-static-64-smtarget\\)",
    ):
        configurations(True, [], "none,green-static-32")


def test_a_gpu_run_measures_the_four_by_default_and_the_static_ones_by_name() -> None:
    assert (
        list(configurations(True, [], None))
        == list(GPU_DEFAULT)
        == ["aggregated", "none", "mps", "green"]
    )
    assert list(configurations(False, [], None)) == ["aggregated", "none", "cpu", "thread"]
    assert list(configurations(True, [], "green-static-64,mps-40")) == ["green-static-64", "mps-40"]
    assert configurations(True, ["x=--policy pd"], "x")["x"].args == "--policy pd"
    with pytest.raises(BenchError, match="NAME=ARGS"):
        configurations(True, ["--policy pd"], None)


def plan_of(config: str, monkeypatch: pytest.MonkeyPatch):
    """The unit `ppd serve` would plan on one GPU for a GPU configuration's serve arguments."""
    import argparse
    import shlex
    import shutil

    import server.plan
    from partition import backends, mps
    from partition.mps import MpsDaemonPlan
    from server.args import add_serve_args

    monkeypatch.setattr(server.plan, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(backends, "green_available", lambda: True)
    monkeypatch.setattr(
        mps,
        "mps_daemon_plan",
        lambda workdir: MpsDaemonPlan(
            "nvidia-cuda-mps-control",
            workdir / "pipe",
            workdir / "log",
            start=True,
            why="a test's daemon",
        ),
    )
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(
        ["--model", "demo", "--device", "cuda", *shlex.split(GPU_CONFIGS[config].args)]
    )
    plan = server.plan.plan_serve(args)
    shutil.rmtree(plan.ipc_dir)
    return plan.units[0]


@pytest.mark.parametrize("sms", [64, 96])
def test_green_static_fixes_decode_on_one_split_without_the_share_manager(
    sms: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partition.green import StreamPair, StreamSplits
    from scheduler.decode_worker import share_manager

    assert GPU_CONFIGS[f"green-static-{sms}"].args.split() == [
        "--policy",
        "pd",
        "--partition",
        "green",
        "--green-decode-sms",
        str(sms),
        "--no-share-manager",
    ]
    unit = plan_of(f"green-static-{sms}", monkeypatch)
    assert (
        unit.policy == "pd" and unit.partition.backend == "green" and unit.partition.prefill_thread
    )
    assert unit.partition.green_sms == (sms,) and not unit.share_manager
    # The decode worker then keeps its one split, alone and beside a prefill: the middle (only) one,
    # no manager.
    splits = StreamSplits(
        132, StreamPair("d", "p", 132, 132), {0: StreamPair("d0", "p0", sms, 132 - sms)}
    )
    assert splits.middle_decode_sms() == sms and share_manager(unit, splits) is None
    assert f"{sms} SMs" in GPU_CONFIGS[f"green-static-{sms}"].decode


@pytest.mark.parametrize("sms", [64, 96])
def test_green_static_smtarget_is_green_static_with_cublas_sized_for_the_split(
    sms: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = GPU_CONFIGS[f"green-static-{sms}-smtarget"]
    assert config.args.split() == GPU_CONFIGS[f"green-static-{sms}"].args.split() + [
        "--cublas-sm-target"
    ]
    assert f"{sms} SMs" in config.decode and "cuBLAS" in config.decode
    unit = plan_of(f"green-static-{sms}-smtarget", monkeypatch)
    assert unit.partition.green_sms == (sms,) and not unit.share_manager


def test_mps_40_caps_the_prefill_worker_at_40_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    assert GPU_CONFIGS["mps-40"].args.split() == [
        "--policy",
        "pd",
        "--partition",
        "mps",
        "--mps-prefill-percent",
        "40",
    ]
    unit = plan_of("mps-40", monkeypatch)
    assert unit.partition.backend == "mps"
    assert (unit.partition.decode.mps_percent, unit.partition.prefill.mps_percent) == (100, 40)
    assert plan_of("mps", monkeypatch).partition.prefill.mps_percent == 80
    assert GPU_CONFIGS["none"].args.split() == ["--policy", "pd", "--partition", "none"]


def test_the_report_says_what_decode_had_and_reads_each_against_none_alone() -> None:
    settings = {
        "batch": 64,
        "context": 1024,
        "prefill_tokens": 4096,
        "rounds": 5,
        "alone_s": 3.0,
        "settle_s": 1.0,
    }

    def measured(alone: float, beside: float, shares: tuple[list, list] | None = None) -> dict:
        found = {
            "serve_args": ["--policy", "pd"],
            "tpot_alone_ms": alone,
            "tpot_beside_ms": beside,
            "ratio": beside / alone,
            "prefill_ms": 300.0,
            "prefill_alone_ms": 200.0,
            "prefill_ratio": 1.5,
        }
        if shares:
            found.update(decode_share_alone=shares[0], decode_share_beside=shares[1])
        return found

    results = {
        "none": {**measured(9.0, 20.0), "decode": GPU_CONFIGS["none"].decode},
        "green-static-64": {
            **measured(10.8, 13.5, ([64], [64])),
            "decode": GPU_CONFIGS["green-static-64"].decode,
        },
        "green": {**measured(9.0, 15.3, ([132], [64, 132])), "decode": GPU_CONFIGS["green"].decode},
    }
    text = report(settings, results)
    # SM loss 10.8 / 9 = 1.20, contention 13.5 / 10.8 = 1.25, the target measure 13.5 / 9 = 1.50.
    assert (
        "| green-static-64 | 64 SMs (a green context), alone and beside; the prefill on the rest | "
        "64 / 64 "
        "| 10.80 | 13.50 | 1.25 | 1.20 | 1.50 | 200 | 300 | 1.50 |"
    ) in text
    assert "| green | the share manager's pick among green splits | 132 / 64, 132 |" in text
    assert (
        "| none | every SM, time-sliced with the prefill worker's process | - / - | 9.00 | 20.00 | "
        "2.22 | 1.00 | "
        "2.22 |" in text
    )
    # Without none (another folder's settings), the columns against it stay empty and the text says
    # why.
    alone = report(settings, {"green": results["green"]})
    assert "none was not measured" in alone and "| 1.70 |  |  | 200 | 300 | 1.50 |" in alone
    # A table an earlier version wrote has no prefill alone: its cells stay empty.
    earlier = {
        k: v for k, v in results["none"].items() if k not in ("prefill_alone_ms", "prefill_ratio")
    }
    assert "| 2.22 | 1.00 | 2.22 |  | 300 |  |" in report(settings, {"none": earlier})
    assert "NVML" not in text  # no configuration read the GPU


def test_the_report_has_the_gpus_readings_in_each_window_or_says_why_there_are_none() -> None:
    settings = {
        "batch": 64,
        "context": 1024,
        "prefill_tokens": 4096,
        "rounds": 5,
        "alone_s": 3.0,
        "settle_s": 1.0,
    }
    base = {
        "serve_args": ["--policy", "pd"],
        "tpot_alone_ms": 9.0,
        "tpot_beside_ms": 18.0,
        "ratio": 2.0,
        "prefill_ms": 300.0,
        "prefill_alone_ms": 250.0,
        "prefill_ratio": 1.2,
    }

    def stats(median: float, low: float, high: float) -> dict:
        return {"median": median, "min": low, "max": high}

    window = {
        "samples": 30,
        "sm_clock_mhz": stats(1980, 1755, 1980),
        "mem_busy_pct": stats(61, 40, 70),
        "dram_bw_pct": stats(48.25, 30.0, 71.5),
        "power_w": stats(512.4, 300.0, 690.2),
        "temp_c": stats(51, 48, 55),
        "slowdowns": ["sw power cap"],
    }
    results = {
        "none": {
            **base,
            "gpu": {
                "device": "NVIDIA H200",
                "sample_s": 0.1,
                "windows": {"beside": window, "decode alone": {"samples": 0, "slowdowns": []}},
            },
        },
        "mps": {**base, "gpu": {"error": "no NVML: ImportError: No module named 'pynvml'"}},
        "cpu": {**base, "gpu": {"error": "no NVML: ImportError: No module named 'pynvml'"}},
    }
    text = report(settings, results)
    assert "## The GPU in each window (NVML)" in text
    assert (
        "| none | beside | 30 | 1980 (1755) | 61 | 48.2 (71.5) | - | 512 (690) | 55 | sw power cap "
        "|" in text
    )
    assert "| none | decode alone | 0 | - | - | - | - | - | - | - |" in text
    assert "No readings for mps, cpu: no NVML: ImportError: No module named 'pynvml'." in text


def test_decodes_share_is_read_from_health_while_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter(
        [
            {"units": [{"partition": {"backend": "green", "decode_share": 132}}]},
            {"units": [{"partition": {"backend": "mps"}}]},
        ]
    )

    class Answer:
        def __init__(self, body: dict) -> None:
            self.body = body

        def json(self) -> dict:
            return self.body

    def get(url: str, timeout: float):
        assert url == "http://server/health"
        return Answer(
            next(answers, {"units": [{"partition": {"backend": "green", "decode_share": 64}}]})
        )

    monkeypatch.setattr(interference.httpx, "get", get)
    monkeypatch.setattr(interference, "SHARE_SAMPLE_S", 0.01)
    shares = Shares("http://server")
    while len(shares.samples) < 3:
        time.sleep(0.01)
    shares.close()
    assert shares.during(0.0, float("inf")) == [64, 132]
    assert shares.during(shares.samples[-1][0] + 1, float("inf")) == []


def test_a_configuration_that_measured_nothing_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert (
        main(["bench", "interference", "--config", "broken=--no-such-flag", "--out", str(tmp_path)])
        == 1
    )
    (line,) = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("not measured:")
    ]
    assert (
        line.startswith("not measured: broken: ")
        and "unrecognized arguments: --no-such-flag" in line
    )
    assert "error" in json.loads((tmp_path / "interference.json").read_text())["results"]["broken"]
    assert (tmp_path / "broken.log").exists()


@pytest.mark.slow  # a whole run against a live server: the second suite
def test_one_configuration_on_the_demo_model(tmp_path: Path) -> None:
    assert (
        main(
            [
                "bench",
                "interference",
                "--config",
                "thread=--policy pd --partition none --prefill-worker thread",
                "--batch",
                "2",
                "--context",
                "16",
                "--prefill-tokens",
                "200",
                "--rounds",
                "2",
                "--alone-s",
                "0.5",
                "--settle-s",
                "0.2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    found = json.loads((tmp_path / "interference.json").read_text())
    result = found["results"]["thread"]
    assert "error" not in result, result
    assert len(result["tpot_beside_each_ms"]) == 2 and len(result["prefill_each_ms"]) == 2
    assert 0 < result["tpot_alone_ms"] < float("inf") and result["ratio"] > 0
    assert len(result["prefill_alone_each_ms"]) == 2 and result["prefill_ratio"] > 0
    assert result["gpu"] == {"error": "no GPU: the server runs on the CPU"}
    assert "| thread |" in (tmp_path / "interference.md").read_text()


# about 14 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_results_are_written_after_each_configuration_and_kept_for_a_later_run(
    tmp_path: Path,
) -> None:
    """A run stopped by a time limit keeps the configurations it measured: the table is rewritten
    after each one, and a later run with the same settings (bench/gpu_check.sh's next device
    call, interference:NAMES) adds to it."""
    sizes = [
        "--batch",
        "2",
        "--context",
        "16",
        "--prefill-tokens",
        "200",
        "--rounds",
        "1",
        "--alone-s",
        "0.3",
        "--settle-s",
        "0.1",
    ]
    settings = {
        "batch": 2,
        "context": 16,
        "prefill_tokens": 200,
        "rounds": 1,
        "alone_s": 0.3,
        "settle_s": 0.1,
    }
    measured = {
        "serve_args": ["--policy", "pd"],
        "tpot_alone_ms": 10.0,
        "tpot_beside_ms": 12.0,
        "ratio": 1.2,
        "tpot_beside_each_ms": [12.0],
        "prefill_each_ms": [300.0],
        "prefill_ms": 300.0,
    }
    (tmp_path / "interference.json").write_text(
        json.dumps({"settings": settings, "results": {"thread": measured}})
    )
    assert (
        main(["bench", "interference", "--config", "other=--nope", *sizes, "--out", str(tmp_path)])
        == 1
    )
    found = json.loads((tmp_path / "interference.json").read_text())["results"]
    assert found["thread"] == measured and "error" in found["other"]
    assert "| thread |" in (tmp_path / "interference.md").read_text()
    # Other settings start a new table.
    assert (
        main(
            [
                "bench",
                "interference",
                "--config",
                "other=--nope",
                *sizes[:-2],
                "--settle-s",
                "0.2",
                "--out",
                str(tmp_path),
            ]
        )
        == 1
    )
    assert set(json.loads((tmp_path / "interference.json").read_text())["results"]) == {"other"}
