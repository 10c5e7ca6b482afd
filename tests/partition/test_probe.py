"""ppd probe: the report without CUDA, the pure verdict and table helpers with synthetic findings,
how failures become findings (in-process, in children, in the MPS daemon's lifecycle, against a
fake control binary), and, marked gpu, the IPC round trip, the overlap and the green contexts for
real."""

from __future__ import annotations

import argparse
import json
import operator
import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from partition import mps, probe, probe_cpu, probe_mps, probe_overlap
from partition.child import apply_env, guarded, run_in_child
from partition.probe import (
    NO_CUDA,
    NO_DRIVER,
    SCHEMA_KEYS,
    SCHEMA_VERSION,
    add_probe_args,
    run_probe,
)
from partition.probe_report import MODES, overlap_verdict, partition_verdict, render_table

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
without_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the path of a machine without CUDA"
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_probe_args(parser)
    return parser.parse_args(list(argv))


# --- the whole probe on a machine without CUDA ----------------------------------------------------


@without_cuda
def test_run_probe_without_cuda_reports_the_host_and_writes_the_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "probe.json"
    assert run_probe(_args("--out", str(out), "--quick")) == 0
    printed = capsys.readouterr().out
    assert NO_CUDA in printed
    assert torch.__version__ in printed and "CPUs" in printed
    report = json.loads(out.read_text())
    assert set(report) == set(SCHEMA_KEYS)
    assert report["schema"] == SCHEMA_VERSION == 1
    assert report["gpus"] == []
    assert report["verdict"]["preferred"] == "cpu"
    assert (
        report["host"]["cpu_count"] == os.cpu_count()
        and report["host"]["torch"] == torch.__version__
    )
    for check in ("ipc", "overlap", "green_contexts", "mps"):
        assert report[check]["ok"] is False and report[check]["skipped"]


@without_cuda
def test_without_out_the_report_goes_to_the_results_folder_and_no_driver_fails_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No --out: probe-<UTC time>.json in $PPD_RESULTS_DIR, named as the probe starts and as it
    ends; on a host without an NVIDIA driver NVML and CUDA are skipped (no FAILED line, no pynvml
    asked) and the CPU is reported."""
    monkeypatch.setenv("PPD_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setattr(probe, "nvidia_driver_present", lambda: False)
    monkeypatch.setattr(
        probe, "nvml_inventory", lambda: pytest.fail("NVML asked on a host without a driver")
    )
    assert run_probe(_args("--quick")) == 0
    (out,) = (tmp_path / "results").glob("probe-*.json")
    printed = capsys.readouterr()
    assert f"the report goes to {out}" in printed.err and printed.out.rstrip().endswith(
        f"wrote {out}"
    )
    assert (
        "FAILED" not in printed.out
        and "nvml                   skipped: no NVIDIA driver" in printed.out
    )
    report = json.loads(out.read_text())
    assert (
        report["host"]["nvml"]["skipped"] == report["host"]["torch_devices"]["skipped"] == NO_DRIVER
    )
    assert report["verdict"]["preferred"] == "cpu" and report["cpu"]["ok"]
    assert "AMX-BF16" in printed.out and "--dtype auto: the demo in float32" in printed.out
    # a CPU host's table says the verdict once; the GPU modes' verdicts stay in the JSON
    assert "verdict                preferred: cpu" in printed.out
    assert "green_in_mps" not in printed.out and "green_in_mps" in report["verdict"]["modes"]


def test_the_cpu_section_says_what_ppd_serve_chooses_on_this_cpu() -> None:
    """In-process, no GPU: the extensions as /proc/cpuinfo lists them, and the dtype and kernels the
    server's own functions choose here."""
    from engine.attention.cpu_linear import amx_rows
    from engine.cpu_isa import has_native_bf16, isa, proc_flags

    cpu = probe_cpu.cpu_facts()
    assert cpu["cpu_count"] == os.cpu_count() and cpu["model"]
    assert cpu["flags"] == {
        flag: flag in proc_flags() for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    }
    assert cpu["ppd_cpu_isa"] == isa() and cpu["native_bf16"] == has_native_bf16()
    bf16 = "bfloat16" if has_native_bf16() else "float32"
    assert cpu["dtype_auto"] == {"demo": "float32", "bfloat16_checkpoint": bf16}
    kernels = cpu["kernels"]
    assert kernels["build"] == isa() and (kernels["library"] is None) == (
        kernels["error"] is not None
    )
    assert kernels["amx_linear_rows"] == (amx_rows() if kernels["library"] else 0)
    assert kernels["amx_linear_rows"] == 0 or cpu["flags"]["amx_bf16"]


def test_a_cpu_without_native_bfloat16_serves_a_bfloat16_checkpoint_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "PPD_CPU_ISA", "avx2"
    )  # AVX-512's and AMX's flags hidden, as on an AVX2-only CPU
    assert probe_cpu.auto_dtypes() == {"demo": "float32", "bfloat16_checkpoint": "float32"}


def test_the_cpu_rows_of_the_table() -> None:
    cpu = {
        "ok": True,
        "error": None,
        "model": "AMD EPYC 9B14",
        "cpu_count": 4,
        "affinity_cpus": 2,
        "flags": {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False},
        "ppd_cpu_isa": "native",
        "native_bf16": True,
        "dtype_auto": {"demo": "float32", "bfloat16_checkpoint": "bfloat16"},
        "kernels": {
            "build": "native",
            "compile_flags": ["-march=native"],
            "library": "/c/k.so",
            "error": None,
            "attention": "ours (cpu_decode.c, cpu_prefill.c)",
            "amx_linear_rows": 0,
            "bfloat16_weights_packed_as": "bfloat16",
            "bfloat16_prefill_attention": "ours",
        },
    }
    table = render_table({"schema": 1, "host": {}, "cpu": cpu, "gpus": []})
    assert "AMD EPYC 9B14 · 4 CPUs (2 usable)" in table
    assert "AVX2 yes · AVX-512F yes · AVX512-BF16 yes · AMX-BF16 no · native bfloat16: yes" in table
    assert "the demo in float32, a bfloat16 checkpoint in bfloat16" in table
    assert (
        "native build (-march=native) · attention: ours (cpu_decode.c, cpu_prefill.c) · no AMX "
        "linears" in table
    )
    broken = render_table(
        {"schema": 1, "host": {}, "cpu": {"ok": False, "error": "ValueError: $PPD_CPU_ISA='x'"}}
    )
    assert "cpu                    FAILED: ValueError: $PPD_CPU_ISA='x'" in broken


@without_cuda
def test_a_probe_that_raises_becomes_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict:
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(
        probe, "nvidia_driver_present", lambda: True
    )  # a driver, whose NVML then fails
    monkeypatch.setattr(probe, "nvml_inventory", broken)
    report = probe.collect(quick=True)
    assert report["host"]["nvml"]["ok"] is False
    assert report["host"]["nvml"]["error"] == "RuntimeError: NVML exploded"
    assert report["verdict"]["preferred"] == "cpu"


def test_collect_on_a_gpu_host_wires_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The orchestration of a GPU run, with each check replaced by a canned finding: what runs, with
    which env."""
    calls: list[tuple[str, dict]] = []
    gpu = {"index": 0, "nvml_index": 3, "name": "NVIDIA H100 80GB HBM3", "sm_count": 132}

    def child(fn, args=(), env=None, timeout=0.0):
        calls.append((fn.__name__, env))
        if fn.__name__ == "ipc_round_trip":
            assert args[1:3] == (64 << 20, 3)
            return {"ok": True, "error": None, "bytes": args[1]}
        return _green()

    def overlap(device, target_ms, env, timeout):
        calls.append(("measure_overlap", env))
        mps = "nvidia-mps-ours" in env["CUDA_MPS_PIPE_DIRECTORY"]
        verdict, ratio = ("concurrent", 1.9) if mps else ("time-sliced", 1.0)
        return {"ok": True, "error": None, "verdict": verdict, "ratio": ratio}

    def mps(device, nvml_index, workdir, under_mps):
        under = under_mps(
            {
                "CUDA_MPS_PIPE_DIRECTORY": str(workdir / "nvidia-mps-ours"),
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None,
            }
        )
        return {
            "daemon": {"ok": True},
            "client": {"is_mps_client": True},
            "under_mps": under,
            "stop": {"stopped": True},
        }

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(probe, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(
        probe, "list_gpus", lambda env, timeout: ([gpu], {"ok": True}, {"ok": True})
    )
    monkeypatch.setattr(probe, "run_in_child", child)
    monkeypatch.setattr(probe, "measure_overlap", overlap)
    monkeypatch.setattr(probe, "probe_mps", mps)
    report = probe.collect(quick=True)
    assert [name for name, _ in calls] == [
        "ipc_round_trip",
        "measure_overlap",
        "green_context_check",
    ] * 2
    assert all("no-mps" in env["CUDA_MPS_PIPE_DIRECTORY"] for _, env in calls[:3])
    assert all("nvidia-mps-ours" in env["CUDA_MPS_PIPE_DIRECTORY"] for _, env in calls[3:])
    assert report["gpus"] == [gpu] and report["overlap"]["verdict"] == "time-sliced"
    assert report["mps"]["ok"] and report["mps"]["under_mps"]["overlap"]["verdict"] == "concurrent"
    assert report["verdict"]["preferred"] == "green_in_mps"
    assert "preferred: green_in_mps" in render_table(report)

    calls.clear()
    skipping = probe.collect(quick=True, skip_mps=True)
    assert len(calls) == 3 and skipping["mps"]["skipped"] == "--skip-mps"
    assert skipping["verdict"]["preferred"] == "green_in_process"
    assert probe.collect(device=1)["ipc"]["error"] == "--device 1: torch sees 1 device(s)"


# --- guarded and children -------------------------------------------------------------------------


def test_guarded_turns_exceptions_and_non_dicts_into_failed_findings() -> None:
    def bad(x: int) -> dict:
        raise ValueError(f"bad {x}")

    found = guarded(bad, 3)
    assert (
        found["ok"] is False
        and found["error"] == "ValueError: bad 3"
        and "in bad" in found["traceback"]
    )
    assert guarded(lambda: 42) == {"ok": False, "error": "the probe returned int, not a dict"}
    assert guarded(lambda: {"x": 1}) == {"x": 1, "ok": True, "error": None}
    assert guarded(lambda: {"ok": False, "error": "told"})["error"] == "told"


def test_a_child_that_raises_or_hangs_is_reported_not_waited_for() -> None:
    raised = run_in_child(operator.truediv, (1, 0), timeout=60)
    assert raised["ok"] is False and raised["error"].startswith("ZeroDivisionError")
    start = time.monotonic()
    hung = run_in_child(time.sleep, (60,), timeout=1)
    assert hung["ok"] is False and "no result within 1 s" in hung["error"]
    assert time.monotonic() - start < 20


def test_apply_env_sets_and_removes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPD_PROBE_GONE", "1")
    monkeypatch.delenv("PPD_PROBE_SET", raising=False)
    apply_env({"PPD_PROBE_SET": "yes", "PPD_PROBE_GONE": None})
    assert os.environ["PPD_PROBE_SET"] == "yes" and "PPD_PROBE_GONE" not in os.environ
    monkeypatch.delenv("PPD_PROBE_SET")


# --- overlap --------------------------------------------------------------------------------------


def _side(solo: float, start: float, end: float) -> dict:
    return {"ok": True, "solo_s": solo, "start": start, "end": end}


@pytest.mark.parametrize(
    "sides, verdict, ratio",
    [
        ([_side(0.2, 10.0, 10.2), _side(0.2, 10.001, 10.205)], "concurrent", 1.951),
        ([_side(0.2, 10.0, 10.4), _side(0.2, 10.001, 10.39)], "time-sliced", 1.0),
        ([_side(0.2, 10.0, 10.28), _side(0.2, 10.001, 10.2)], "inconclusive", 1.429),
    ],
)
def test_overlap_verdict_from_timings(sides: list[dict], verdict: str, ratio: float) -> None:
    found = overlap_verdict(sides)
    assert found["verdict"] == verdict and found["ratio"] == ratio
    assert f"{ratio:.2f}" in found["reason"]


def test_overlap_is_inconclusive_when_a_side_failed_or_the_launches_were_apart() -> None:
    failed = overlap_verdict(
        [_side(0.2, 10.0, 10.2), {"ok": False, "error": "Triton would not compile"}]
    )
    assert failed["verdict"] == "inconclusive" and failed["ratio"] is None
    assert "Triton would not compile" in failed["reason"]
    apart = overlap_verdict([_side(0.2, 10.0, 10.2), _side(0.2, 10.2, 10.4)])
    assert apart["verdict"] == "inconclusive" and "200 ms apart" in apart["reason"]


def test_overlap_sides_calibrate_in_turn_and_a_failing_side_does_not_block_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[int] = []

    def calibrate(launch: object, target_ms: float) -> tuple:
        index = int(threading.current_thread().name)
        order.append(index)
        if index == 1:
            raise RuntimeError("no kernel here")
        return (lambda: time.sleep(0.01)), 0.01, 16

    monkeypatch.setattr(probe_overlap, "_launcher", lambda kernel, device: None)
    monkeypatch.setattr(probe_overlap, "_calibrate", calibrate)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    barrier, sides = threading.Barrier(2), {}

    def side(index: int) -> None:
        sides[index] = probe_overlap._run_together(index, barrier, "spin", 0, 10.0, 10.0)

    threads = [threading.Thread(target=side, args=(i,), name=str(i)) for i in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert order == [0, 1]
    assert sides[0]["ok"] and sides[0]["end"] > sides[0]["start"]
    assert sides[1] == {"ok": False, "error": "RuntimeError: no kernel here"}


def test_spin_kernel_does_the_arithmetic_it_is_asked_for() -> None:
    import numpy as np

    from partition.probe_kernels import BLOCK, spin

    if torch.cuda.is_available():
        pytest.skip(
            "checked under TRITON_INTERPRET on the CPU; the GPU overlap test runs it for real"
        )
    out = torch.empty(2 * BLOCK)
    spin(out, 5)
    expected = np.arange(2 * BLOCK, dtype=np.float32)
    for _ in range(5):
        expected = expected * np.float32(0.999999) + np.float32(1.0)
    np.testing.assert_array_equal(out.numpy(), expected)


# --- the partition verdict ------------------------------------------------------------------------


def _green(ok: bool = True, slowdown: float = 7.5, graph: bool = True, lost: bool = False) -> dict:
    return {
        "ok": ok,
        "error": None if ok else "cuda-bindings unavailable",
        "matmul": {"ok": True, "small_slowdown": slowdown, "small_granted": 16},
        "graph": {
            "ok": graph,
            "error": None if graph else "capture failed",
            "matches_eager": graph,
            "keeps_partition": not lost,
            "slowdown": 1.1 if lost else 7.0,
            "max_abs_diff": 0.0,
        },
    }


def _mps(
    started: bool = True,
    client: bool = True,
    overlap: str = "concurrent",
    ipc: bool = True,
    green: dict | None = None,
) -> dict:
    return {
        "ok": started and client,
        "error": None,
        "daemon": {
            "ok": started,
            "error": None if started else "nvidia-cuda-mps-control -d exited with 1",
        },
        "client": {"ok": True, "is_mps_client": client},
        "under_mps": {
            "ipc": {"ok": ipc, "error": None if ipc else "cudaIpcOpenMemHandle failed"},
            "overlap": {
                "ok": True,
                "verdict": overlap,
                "ratio": 1.9 if overlap == "concurrent" else 1.0,
                "reason": "ratio",
            },
            "green_contexts": green or _green(),
        },
    }


def _report(ipc: bool = True, green: dict | None = None, mps: dict | None = None) -> dict:
    return {
        "schema": 1,
        "host": {"hostname": "gpu-host", "cpu_count": 16, "torch": "2.11.0+cu130"},
        "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "sm_count": 132}],
        "ipc": {"ok": ipc, "error": None if ipc else "msgspec missing", "bytes": 2**30},
        "overlap": {
            "ok": True,
            "verdict": "time-sliced",
            "ratio": 1.01,
            "spin": {"reason": "waited"},
        },
        "green_contexts": green or _green(),
        "mps": _mps() if mps is None else mps,
    }


@pytest.mark.parametrize(
    "report, preferred, mode, reason",
    [
        (_report(), "green_in_mps", "green_in_mps", "inside an MPS client: 16 SMs granted"),
        (
            _report(mps={"ok": False, "error": None, "skipped": "--skip-mps"}),
            "green_in_process",
            "mps_processes",
            "--skip-mps",
        ),
        (_report(mps=_mps(started=False)), "green_in_process", "mps_processes", "did not start"),
        (
            _report(mps=_mps(client=False)),
            "green_in_process",
            "mps_processes",
            "did not run as an MPS client",
        ),
        (
            _report(mps=_mps(overlap="time-sliced")),
            "green_in_process",
            "mps_processes",
            "time-sliced",
        ),
        (
            _report(mps=_mps(ipc=False)),
            "green_in_process",
            "mps_processes",
            "cudaIpcOpenMemHandle failed",
        ),
        (
            _report(mps={**_mps(), "under_mps": {"ok": False, "error": "KeyError: 'ipc'"}}),
            "green_in_process",
            "mps_processes",
            "checks under our MPS daemon failed: KeyError",
        ),
        (
            _report(mps=_mps(green=_green(ok=False))),
            "mps_processes",
            "green_in_mps",
            "cuda-bindings unavailable",
        ),
        (
            _report(green=_green(slowdown=1.1), mps=_mps(started=False)),
            "time_sliced_only",
            "green_in_process",
            "only 1.1x slower",
        ),
        (
            _report(green=_green(lost=True), mps=_mps(started=False)),
            "time_sliced_only",
            "green_in_process",
            "lost the partition",
        ),
        (
            _report(green=_green(graph=False), mps=_mps(started=False)),
            "time_sliced_only",
            "green_in_process",
            "capture failed",
        ),
        (
            _report(ipc=False, green=_green(ok=False), mps=_mps(started=False)),
            "none",
            "time_sliced_only",
            "msgspec missing",
        ),
    ],
)
def test_partition_verdict(report: dict, preferred: str, mode: str, reason: str) -> None:
    verdict = partition_verdict(report)
    assert verdict["preferred"] == preferred
    assert set(verdict["modes"]) == set(MODES)
    assert reason in verdict["modes"][mode]["reason"]
    if preferred in MODES:
        assert verdict["modes"][preferred]["usable"]


def test_partition_verdict_without_gpus_is_cpu_unless_listing_them_failed() -> None:
    verdict = partition_verdict({"gpus": []})
    assert verdict["preferred"] == "cpu"
    assert not any(mode["usable"] for mode in verdict["modes"].values())
    listing = {
        "ok": False,
        "error": "torch_inventory: the child exited with code -11 without a result",
    }
    failed = partition_verdict({"gpus": [], "host": {"torch_devices": listing}})
    assert failed["preferred"] == "none"
    assert (
        "could not list the CUDA devices: torch_inventory"
        in failed["modes"]["mps_processes"]["reason"]
    )


# --- the table ------------------------------------------------------------------------------------


def test_render_table_shows_each_section_and_survives_a_malformed_one() -> None:
    report = _report()
    report["verdict"] = partition_verdict(report)
    table = render_table(report)
    assert "NVIDIA H100 80GB HBM3 · 132 SMs" in table
    assert "preferred: green_in_mps" in table
    assert "time-sliced: waited" in table
    assert "FAILED" not in render_table({**report, "ipc": {"ok": True, "bytes": 2**30}})
    assert "FAILED: msgspec missing" in render_table(_report(ipc=False))
    broken = render_table({**report, "gpus": "garbage"})
    assert "cannot render" in broken and "preferred: green_in_mps" in broken


# --- MPS daemon lifecycle against a fake nvidia-cuda-mps-control ----------------------------------

FAKE_CONTROL = """#!{python}
# A stand-in for nvidia-cuda-mps-control: -d starts a daemon (with a fake server child) that writes
# its pid file into CUDA_MPS_PIPE_DIRECTORY and exits on "quit" (unless FAKE_IGNORE_QUIT is set).
import os, subprocess, sys, time
from pathlib import Path
pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
args = sys.argv[1:]
if args == ["-h"]:
    print("usage: nvidia-cuda-mps-control [-d | -f | -S]")
elif args == ["-v"]:
    print("13010")
elif args == ["-d"]:
    subprocess.Popen([sys.executable, __file__, "--serve"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
elif args == ["--serve"]:
    server = subprocess.Popen([sys.executable, __file__, "--server"])
    (pipe / "server.pid").write_text(str(server.pid))
    (pipe / "nvidia-cuda-mps-control.pid").write_text(str(os.getpid()))
    deadline = time.time() + 60
    while not (pipe / "quit").exists() and time.time() < deadline:
        time.sleep(0.02)
    server.kill()
    server.wait()
elif args == ["--server"]:
    time.sleep(60)
else:
    for line in sys.stdin:
        command = line.split()
        if command == ["get_server_list"]:
            print((pipe / "server.pid").read_text())
        elif command == ["quit"] and not os.environ.get("FAKE_IGNORE_QUIT"):
            (pipe / "quit").touch()
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / probe_mps.CONTROL
    script.write_text(FAKE_CONTROL.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(
        probe_mps,
        "check_client",
        lambda daemon, device, nvml_index, env: {
            "ok": True,
            "error": None,
            "is_mps_client": True,
            "sm_count": 66 if env else 132,
        },
    )
    monkeypatch.setattr(mps, "STOP_TIMEOUT_S", 2.0)
    return tmp_path / "work"


@pytest.mark.parametrize("ignore_quit", [False, True])
def test_mps_probe_starts_our_daemon_runs_clients_under_it_and_always_stops_it(
    fake_control: Path, monkeypatch: pytest.MonkeyPatch, ignore_quit: bool
) -> None:
    if ignore_quit:
        monkeypatch.setenv("FAKE_IGNORE_QUIT", "1")
    seen_env: list[dict] = []

    def under_mps(env: dict) -> dict:
        seen_env.append(env)
        return {"ipc": {"ok": True}}

    found = probe_mps.probe_mps(0, None, fake_control, under_mps)
    assert found["daemon"]["ok"], found
    assert (
        found["static_partitioning"]["offered"]
        and found["static_partitioning"]["version"] == "13010"
    )
    assert seen_env[0]["CUDA_MPS_PIPE_DIRECTORY"] == str(fake_control / "mps-pipe")
    assert seen_env[0]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] is None
    assert (
        found["under_mps"]["ipc"] == {"ok": True}
        and found["thread_percentage_50"]["sm_count"] == 66
    )
    assert found["stop"]["stopped"] and found["ok"], found["stop"]
    assert bool(found["stop"]["signalled"]) == ignore_quit
    assert not mps.still_running(set(found["stop"]["pids"]))


def test_mps_probe_without_the_control_binary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    found = probe_mps.probe_mps(0, None, tmp_path, lambda env: {})
    assert found["ok"] is False and "not on PATH" in found["error"]
    assert partition_verdict(_report(mps=found))["modes"]["mps_processes"]["reason"].startswith(
        "our MPS daemon"
    )


# --- on a GPU -------------------------------------------------------------------------------------


def _no_mps(tmp_path: Path) -> dict:
    """An empty pipe directory: whatever MPS daemon the host runs, these children are not its
    clients."""
    return {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None}


@pytest.mark.gpu
@needs_cuda
def test_ipc_round_trip_on_gpu(tmp_path: Path) -> None:
    pytest.importorskip("msgspec")
    from partition.probe_ipc import ipc_round_trip

    found = run_in_child(ipc_round_trip, (0, 64 << 20, None, 120.0), _no_mps(tmp_path), timeout=300)
    assert found["ok"], found
    assert found["verified_a"] and found["verified_b"]
    assert found["mapped_not_copied"], found
    assert found["importer_allocated_delta_bytes"] < 1 << 20


@pytest.mark.gpu
@needs_cuda
def test_overlap_on_gpu(tmp_path: Path) -> None:
    found = probe_overlap.measure_overlap(0, 50.0, _no_mps(tmp_path), 240.0)
    assert found["ok"], found
    assert found["verdict"] in ("concurrent", "time-sliced", "inconclusive")
    for side in found["sides"]:
        assert side["spin"]["ok"] and side["spin"]["solo_s"] > 0.02, side


@pytest.mark.gpu
@needs_cuda
def test_green_contexts_on_gpu(tmp_path: Path) -> None:
    pytest.importorskip("cuda.bindings")
    from partition.probe_green import green_context_check

    found = run_in_child(green_context_check, (0, True), _no_mps(tmp_path), timeout=300)
    assert found["ok"], found
    total, small = found["device_sm_count"], found["groups"]["small"]["granted"]
    assert 16 <= small < total
    assert found["groups"]["pair_a"]["granted"] + found["groups"]["pair_b"]["granted"] <= total
    pair = found["pair_sm_ids"]
    assert pair["ok"] and pair["disjoint"], (
        pair
    )  # the pair's kernels ran on different SMs, seen on the device
    assert 0 < pair["pair_a_sms"] <= found["groups"]["pair_a"]["granted"], pair
    assert 0 < pair["pair_b_sms"] <= found["groups"]["pair_b"]["granted"], pair
    assert found["matmul"]["small_slowdown"] > 1.0
    assert found["graph"]["matches_eager"], found["graph"]
    assert found["context_restored"] and found["cleanup_errors"] == []


@pytest.mark.gpu
@needs_cuda
def test_run_probe_quick_without_mps_on_gpu(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    assert run_probe(_args("--out", str(out), "--quick", "--skip-mps")) == 0
    report = json.loads(out.read_text())
    assert set(report) == set(SCHEMA_KEYS)
    assert report["gpus"] and report["gpus"][0]["sm_count"] > 0
    assert report["mps"]["skipped"] == "--skip-mps"
    assert report["verdict"]["preferred"] in (*MODES, "none")
