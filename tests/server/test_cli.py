"""`ppd serve` refuses bad input with a clear message before starting any process.

The refusals run `ppd`'s main in the test process: each is decided before a worker or the API
server starts, and a process of its own would only add seconds of imports to every case. A command
line that gets past the checks fails the test instead of starting a server."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_model


@dataclass
class Refusal:
    returncode: int
    stderr: str


def serve(*args: str) -> Refusal:
    """`ppd serve args` up to the point where it would start the workers: its exit status and what
    it printed to stderr."""
    import scheduler.worker_setup
    import server.serve
    from cli.main import main

    def started(*_args: object) -> None:
        raise AssertionError(f"ppd serve {' '.join(args)} passed its checks: it would start")

    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setattr(server.serve, "api_client", started)
        patch.setattr(scheduler.worker_setup, "set_process_title", lambda title: None)
        try:
            code = main(["serve", *args])
        except SystemExit as exc:  # argparse's errors
            code = exc.code
    return Refusal(code, stderr.getvalue())


def serve_process(*args: str) -> subprocess.CompletedProcess:
    """`ppd serve args` in a process of its own, for a refusal that comes from a started worker."""
    return subprocess.run(
        [sys.executable, "-m", "cli", "serve", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def test_missing_folder(tmp_path: Path) -> None:
    result = serve("--model", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "nowhere" in result.stderr and "Traceback" not in result.stderr


def test_unsupported_architecture(tmp_path: Path, tiny: Path) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    result = serve("--model", str(folder))
    assert result.returncode == 2 and "gpt2" in result.stderr and "llama" in result.stderr


def test_missing_tensors_named(tmp_path: Path, tiny: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((tiny / "config.json").read_text())
    tensors = load_file(tiny / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    started = time.monotonic()
    result = serve("--model", str(folder))
    assert result.returncode == 2 and "model.layers.1.mlp.down_proj.weight" in result.stderr
    assert time.monotonic() - started < 60  # refused up front, not after starting workers


def test_context_longer_than_model(tiny: Path) -> None:
    result = serve("--model", str(tiny), "--max-model-len", "100000")
    assert result.returncode == 2 and "--max-model-len" in result.stderr


def test_token_budget_below_batch_size() -> None:
    result = serve("--max-num-seqs", "64", "--max-num-batched-tokens", "32")
    assert result.returncode == 2 and "--max-num-batched-tokens" in result.stderr


def test_graph_tokens_out_of_range_are_refused() -> None:
    result = serve("--max-graph-tokens", "4096")
    assert (
        result.returncode == 2
        and "--max-graph-tokens 4096: give 0" in result.stderr
        and "1024" in result.stderr
    )


def test_a_prefill_batch_below_one_token_is_refused() -> None:
    result = serve("--prefill-batch-tokens", "0")
    assert result.returncode == 2 and "--prefill-batch-tokens must be at least 1" in result.stderr


def test_cuda_without_a_gpu_is_refused() -> None:
    result = serve("--device", "cuda")
    assert (
        result.returncode == 2
        and "no CUDA device" in result.stderr
        and "--device cpu" in result.stderr
    )


def test_triton_backend_on_the_cpu_is_refused() -> None:
    result = serve("--attention-backend", "triton", "--device", "cpu")
    assert result.returncode == 2 and "--attention-backend cpu" in result.stderr


def test_bad_memory_utilization_is_refused() -> None:
    result = serve("--gpu-memory-utilization", "1.5")
    assert result.returncode == 2 and "--gpu-memory-utilization" in result.stderr


# about 13 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_the_cublas_sm_target_is_for_green_only_and_says_so() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "--cublas-sm-target" in " ".join(help_text.split())
    assert "only with --partition green, where graphs are captured per split" in " ".join(
        help_text.split()
    )
    result = serve_process("--cublas-sm-target", "--partition", "none")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "--cublas-sm-target is for --partition green, where graphs are captured per split, not none"
        in result.stderr
    )


def test_the_cublas_sm_target_reaches_the_engine_config_of_every_unit(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU host (as far as planning can tell) with green contexts: each unit's engine captures
    with the target; without the flag, none does; with --enforce-eager (no graphs to capture) it is
    refused."""
    import argparse
    import shutil

    import server.plan
    from partition import backends
    from server.args import add_serve_args

    monkeypatch.setattr(server.plan, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(backends, "green_available", lambda: True)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    base = ["--model", str(tiny), "--skip-tokenizer-init", "--partition", "green", "--policy", "pd"]
    for extra, on in ((["--cublas-sm-target"], True), ([], False)):
        plan = server.plan.plan_serve(parser.parse_args(base + extra))
        shutil.rmtree(plan.ipc_dir)
        assert plan.partition == "green" and len(plan.units) == 2
        assert [u.engine.cublas_sm_target for u in plan.units] == [on, on]
    with pytest.raises(server.plan.UsageError, match="with --enforce-eager none are"):
        server.plan.plan_serve(parser.parse_args(base + ["--cublas-sm-target", "--enforce-eager"]))


def test_a_port_in_use_is_refused_before_any_worker_starts() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = serve("--port", str(port))
    assert result.returncode == 2 and f"port {port}" in result.stderr and "--port" in result.stderr
    assert time.monotonic() - started < 30


def test_more_units_than_cores_warns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    import server.plan
    from server.args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    monkeypatch.setattr(server.plan, "available_cores", lambda: [0, 1])
    with caplog.at_level("WARNING", logger="ppd"):
        plan = server.plan.plan_serve(parser.parse_args(["--units", "4", "--policy", "ppd"]))
    import shutil

    shutil.rmtree(plan.ipc_dir)
    assert len(plan.units) == 4
    assert "8 worker processes on 2 core(s)" in caplog.text and "--units 1" in caplog.text


@pytest.mark.parametrize(
    ("cores", "asked", "chosen"),
    [
        (2, "auto", "aggregated"),
        (3, "auto", "aggregated"),
        (4, "auto", "ppd"),
        (8, "auto", "ppd"),
        (2, "ppd", "ppd"),
        (2, "dlocal", "dlocal"),
    ],
)
def test_the_default_policy_on_the_cpu_fits_its_cores_and_says_why(
    cores: int,
    asked: str,
    chosen: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--policy auto: one engine on every core below 4 cores per unit (a 1+1 split lost to it on 2
    cores), the split from 4; an explicit policy is kept. The log line says which and why."""
    import argparse
    import shutil

    import server.plan
    from server.args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    monkeypatch.setattr(server.plan, "available_cores", lambda: list(range(cores)))
    with caplog.at_level("INFO", logger="ppd"):
        plan = server.plan.plan_serve(parser.parse_args(["--device", "cpu", "--policy", asked]))
    shutil.rmtree(plan.ipc_dir)
    assert [u.policy for u in plan.units] == [chosen]
    assert (f"policy: auto: {chosen}" in caplog.text) == (asked == "auto")


def test_mps_that_does_not_work_falls_back_under_auto_and_stops_an_explicit_mps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon started, but no client runs under it (its server failed, as it may in a VM):
    --partition auto stops our daemon and goes on without MPS, saying why; --partition mps is
    refused with the same reason."""
    import argparse
    import shutil

    import server.plan
    from partition import backends, mps
    from partition.backends import PartitionError
    from partition.mps import MpsDaemonPlan
    from server.args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([])
    plan = server.plan.plan_serve(args)
    shutil.rmtree(plan.ipc_dir)
    events = []

    class Daemon:
        def __init__(self, plan: MpsDaemonPlan) -> None:
            pass

        def start(self) -> None:
            events.append("start")

        def stop(self) -> None:
            events.append("stop")

    def no_mps_client(plan: MpsDaemonPlan) -> None:
        events.append("check")
        raise PartitionError(
            "--partition mps: a CUDA client of the MPS daemon does not run as an MPS client "
            "(mps-client: the child exited with code 1 without a result)"
        )

    monkeypatch.setattr(mps, "MpsDaemon", Daemon)
    monkeypatch.setattr(mps, "check_mps_client", no_mps_client)
    monkeypatch.setattr(backends, "green_available", lambda: False)
    daemon_plan = MpsDaemonPlan(
        "/usr/bin/nvidia-cuda-mps-control",
        tmp_path / "pipe",
        tmp_path / "log",
        start=True,
        why="starting an MPS daemon",
    )
    plan.mps, args.partition = daemon_plan, "auto"
    units, planned = plan.units, list(plan.units)
    with caplog.at_level("WARNING", logger="ppd"):
        daemon, fallen = server.plan.start_mps(args, plan)
    assert daemon is None and events == ["start", "check", "stop"]
    assert fallen.partition == "none" and fallen.mps is None
    assert all(u.partition.backend == "none" and not u.partition.env for u in fallen.units)
    assert (
        "MPS does not work here" in fallen.units[0].partition.why
        and "exited with code 1" in caplog.text
    )
    # A new plan: the one planned, whose units list others may hold, is left as it was.
    assert (
        plan.units is units
        and units == planned
        and plan.mps is daemon_plan
        and fallen.units is not units
    )
    assert "going on with --partition none" in caplog.text
    events.clear()
    plan.mps, args.partition = daemon_plan, "mps"
    with pytest.raises(server.plan.UsageError, match="does not run as an MPS client"):
        server.plan.start_mps(args, plan)
    assert events == ["start", "check", "stop"]


@pytest.mark.parametrize("prefill_worker", ["auto", "process"])
def test_mps_that_does_not_work_falls_back_to_green_only_where_the_settings_allow(
    prefill_worker: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """auto's fallback from MPS follows --partition green's rules: green contexts with the prefill
    worker a thread, but not over --prefill-worker process (green splits SMs only inside a process),
    which keeps its process on the time-sliced baseline and says why."""
    import argparse
    import shutil

    import server.plan
    from partition import backends, mps
    from partition.backends import PartitionError
    from partition.mps import MpsDaemonPlan
    from server.args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--policy", "ppd", "--prefill-worker", prefill_worker])
    plan = server.plan.plan_serve(args)
    shutil.rmtree(plan.ipc_dir)

    def no_mps_client(plan: MpsDaemonPlan) -> None:
        raise PartitionError("--partition mps: a CUDA client does not run as an MPS client")

    monkeypatch.setattr(mps, "check_mps_client", no_mps_client)
    monkeypatch.setattr(backends, "green_available", lambda: True)
    plan.device, args.partition = (
        "NVIDIA H100 80GB HBM3",
        "auto",
    )  # a GPU host, as far as the fallback can tell
    plan.mps = MpsDaemonPlan(
        "/usr/bin/nvidia-cuda-mps-control",
        tmp_path / "pipe",
        tmp_path / "log",
        start=False,
        why="an MPS daemon is running",
    )
    units, planned = plan.units, list(plan.units)
    with caplog.at_level("WARNING", logger="ppd"):
        daemon, fallen = server.plan.start_mps(args, plan)
    assert daemon is None and plan.units is units and units == planned and plan.partition == "cpu"
    part = fallen.units[0].partition
    if prefill_worker == "auto":
        assert fallen.partition == part.backend == "green" and part.prefill_thread
        assert fallen.units[0].share_manager, (
            "green's share manager, on by default, is planned with green"
        )
    else:
        assert fallen.partition == part.backend == "none" and not part.prefill_thread, (
            "the process asked for stays"
        )
        assert not fallen.units[0].share_manager and fallen.units[0].partition_profile is None
        assert (
            "--prefill-worker process" in part.why
            and "going on with --partition none" in caplog.text
        )


def test_leftovers_of_dead_servers_are_removed(tmp_path: Path) -> None:
    import os

    from server.plan import remove_dead_leftovers

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"ppd-{dead.pid}-abcd").mkdir()
    (tmp_path / f"ppd-{dead.pid}-abcd" / "u0-requests").write_text("")
    (tmp_path / f"ppd-{dead.pid}-u0-kv").write_bytes(b"\0" * 16)
    mine = [
        tmp_path / f"ppd-{os.getpid()}-efgh",
        tmp_path / "ppd-profile-serve-1.log",
        tmp_path / "other",
    ]
    for path in mine:
        path.write_text("")
    removed = remove_dead_leftovers((tmp_path,))
    assert sorted(p.name for p in removed) == [f"ppd-{dead.pid}-abcd", f"ppd-{dead.pid}-u0-kv"]
    assert all(p.exists() for p in mine)


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}'],
            "unknown key(s) endpont",
        ),
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true}', "--stub-engine", "5"],
            "stub engine keeps no KV",
        ),
    ],
)
def test_bad_kv_events_config_is_refused(args: list[str], needle: str) -> None:
    result = serve(*args)
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow  # a server of its own (over 10 s on 2 cores): the second suite
def test_a_kv_events_endpoint_in_use_stops_the_server_with_its_name(tmp_path: Path) -> None:
    import zmq

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        result = serve_process(
            "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}),
            "--policy",
            "aggregated",
        )
    finally:
        taken.close(0)
        ctx.term()
    assert result.returncode == 2
    assert (
        f"cannot open tcp://*:{port}" in result.stderr and "Address already in use" in result.stderr
    )
