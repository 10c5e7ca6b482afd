"""The partition backends' plans (which backend, each worker's share, the MPS daemon to use or
start), what a worker applies at start, and repinning a running process. The GPU checks skip
cleanly without CUDA."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from partition import backends
from partition.backends import PartitionError, Share, apply_at_start, plan_partitions
from partition.cpu import repin
from partition.mps import PID_FILE


@pytest.fixture
def no_mps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A host without MPS: no control binary, no daemon behind the pipe directory (and no
    cuda-python for green)."""
    monkeypatch.setattr(backends.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-daemon"))
    monkeypatch.setattr(backends, "green_available", lambda: False)


def test_auto_on_the_cpu_pins_each_worker_to_its_own_cores(tmp_path: Path) -> None:
    kind, parts, daemon = plan_partitions("auto", "cpu", 1, True, [0, 1], tmp_path)
    assert kind == "cpu" and daemon is None
    assert (parts[0].decode, parts[0].prefill, parts[0].cores) == (Share((0,)), Share((1,)), (0, 1))
    assert parts[0].runtime_shares and "auto" in parts[0].why
    one_core = plan_partitions("cpu", "cpu", 1, True, [0], tmp_path)[1][0]
    assert not one_core.runtime_shares  # nothing to move between


def test_none_is_labelled_as_the_time_sliced_baseline(tmp_path: Path) -> None:
    kind, parts, _ = plan_partitions("none", "cuda", 2, True, [0, 1], tmp_path)
    assert kind == "none" and len(parts) == 2
    assert (
        parts[0].describe() == "none (the workers time-share the device)"
        and not parts[0].runtime_shares
    )


@pytest.mark.parametrize(
    "kind, device, needle",
    [("cpu", "cuda", "--partition mps, none or auto"), ("mps", "cpu", "needs a GPU")],
)
def test_a_backend_for_the_wrong_device_says_which_to_use(
    tmp_path: Path, kind: str, device: str, needle: str
) -> None:
    with pytest.raises(PartitionError, match=needle):
        plan_partitions(kind, device, 1, True, [0, 1], tmp_path)


def test_mps_without_mps_on_the_host_names_the_fix(no_mps, tmp_path: Path) -> None:
    with pytest.raises(PartitionError, match="nvidia-cuda-mps-control"):
        plan_partitions("mps", "cuda", 1, True, [0, 1], tmp_path)
    kind, parts, _ = plan_partitions("auto", "cuda", 1, True, [0, 1], tmp_path)
    assert kind == "none" and "time-sliced" in parts[0].why and "install MPS" in parts[0].why


def test_mps_starts_a_private_daemon_when_none_runs(
    no_mps, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(backends.shutil, "which", lambda name: "/usr/bin/nvidia-cuda-mps-control")
    kind, parts, daemon = plan_partitions("auto", "cuda", 2, True, [0, 1], tmp_path, (100, 60))
    assert kind == "mps" and daemon.start and daemon.pipe_dir == tmp_path / "mps-pipe"
    env = dict(parts[0].env)
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps-pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps-log"),
    }
    assert (parts[0].decode.mps_percent, parts[0].prefill.mps_percent) == (100, 60)
    assert backends.backend_of(parts[0]).stats(parts[0]) == {
        "backend": "mps",
        "decode_percent": 100,
        "prefill_percent": 60,
    }, "what /health shows"
    aggregated = plan_partitions("mps", "cuda", 1, False, [0, 1], tmp_path)[1][0]
    assert aggregated.prefill == Share() and aggregated.decode.mps_percent == 100
    with pytest.raises(PartitionError, match="--mps-prefill-percent 0"):
        plan_partitions("mps", "cuda", 1, True, [0, 1], tmp_path, (100, 0))


def test_mps_uses_a_daemon_that_runs(
    no_mps, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pipe = tmp_path / "running"
    pipe.mkdir()
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")  # a live process behind the pid file
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    kind, parts, daemon = plan_partitions("auto", "cuda", 1, True, [0, 1], tmp_path)
    assert (
        kind == "mps"
        and not daemon.start
        and dict(parts[0].env) == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    )


def test_an_mps_daemon_whose_client_does_not_run_under_it_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The control daemon starts its server only for the first client, so a daemon may start and MPS
    still fail (in a VM, say): the check runs one client, in a child with a timeout, and says what
    it saw."""
    import partition.mps as mps

    asked = []

    def client_died(daemon, device, nvml_index, extra_env, timeout):
        asked.append((daemon.pipe_dir, device, timeout))
        return {
            "ok": False,
            "error": "mps-client: no result within 60 s; the child was killed",
            "is_mps_client": False,
        }

    plan = mps.MpsDaemonPlan(
        "/usr/bin/nvidia-cuda-mps-control",
        tmp_path / "mps-pipe",
        tmp_path / "mps-log",
        start=True,
        why="starting an MPS daemon",
    )
    monkeypatch.setattr(mps, "check_client", client_died)
    with pytest.raises(
        PartitionError, match=r"does not run as an MPS client \(mps-client: no result within 60 s"
    ):
        mps.check_mps_client(plan, timeout=60.0)
    assert asked == [(tmp_path / "mps-pipe", 0, 60.0)]
    monkeypatch.setattr(mps, "check_client", lambda *args: {"ok": True, "is_mps_client": True})
    mps.check_mps_client(plan)


def test_a_worker_applies_its_share_before_cuda(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(backends.shutil, "which", lambda name: "/usr/bin/nvidia-cuda-mps-control")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-daemon"))
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "unset")  # monkeypatch restores both afterwards
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "unset")
    part = plan_partitions("mps", "cuda", 1, True, [0, 1], tmp_path, (90, 40))[1][0]
    apply_at_start(part, "prefill")
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps-pipe")


def test_repin_moves_every_thread_of_a_running_process() -> None:
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        target = (min(before),)
        repin(target)
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == set(target), tid
        assert torch.get_num_threads() == 1
    finally:
        stop.set()
        worker.join()
        repin(tuple(sorted(before)))
        torch.set_num_threads(threads)


def test_without_mps_auto_runs_each_unit_as_one_process_on_green_splits(
    no_mps, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(backends, "green_available", lambda: True)
    kind, parts, daemon = plan_partitions("auto", "cuda", 2, True, [0, 1], tmp_path)
    assert kind == "green" and daemon is None and len(parts) == 2
    assert parts[0].prefill_thread and parts[0].runtime_shares and "no MPS" in parts[0].why
    # Aggregated serving has no prefill worker to overlap with: nothing to split.
    assert plan_partitions("auto", "cuda", 1, False, [0, 1], tmp_path)[0] == "none"


def test_green_takes_the_decode_sm_counts_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(backends, "green_available", lambda: True)
    part = plan_partitions("green", "cuda", 1, True, [0], tmp_path, green_sms=(96, 32, 64, 32))[1][
        0
    ]
    assert part.green_sms == (32, 64, 96) and part.prefill_thread
    assert "32,64,96 SMs" in part.describe()
    with pytest.raises(PartitionError, match="--green-decode-sms: SM counts must be positive"):
        plan_partitions("green", "cuda", 1, True, [0], tmp_path, green_sms=(0, 64))


@pytest.mark.parametrize(
    "args, needle",
    [
        (("green", "cpu", True, "auto"), "on the CPU use --partition cpu"),
        (("green", "cuda", False, "auto"), "aggregated runs no prefill worker"),
        (("green", "cuda", True, "process"), "only inside one process"),
        (("cpu", "cpu", True, "thread"), "shares are per process"),
        (("mps", "cuda", True, "thread"), "shares are per process"),
        (("none", "cuda", False, "thread"), "runs no prefill worker"),
    ],
)
def test_a_layout_that_cannot_work_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: tuple, needle: str
) -> None:
    monkeypatch.setattr(backends, "green_available", lambda: True)
    kind, device, with_prefill, worker = args
    with pytest.raises(PartitionError, match=needle):
        plan_partitions(kind, device, 1, with_prefill, [0, 1], tmp_path, prefill_worker=worker)


def test_green_without_cuda_python_names_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(backends, "green_available", lambda: False)
    with pytest.raises(PartitionError, match="pip install cuda-python"):
        plan_partitions("green", "cuda", 1, True, [0], tmp_path)
    with pytest.raises(PartitionError, match="--green-decode-sms is for --partition green"):
        plan_partitions("none", "cuda", 1, True, [0], tmp_path, green_sms=(64,))


@pytest.mark.parametrize("kind", ["none", "mps", "cpu", "auto"])
def test_the_cublas_sm_target_is_refused_under_any_partition_but_green(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    monkeypatch.setattr(backends, "green_available", lambda: True)
    monkeypatch.setattr(
        backends.shutil, "which", lambda name: f"/usr/bin/{name}"
    )  # auto picks mps where it is
    device = "cpu" if kind == "cpu" else "cuda"
    with pytest.raises(
        PartitionError,
        match="--cublas-sm-target is for --partition green, where graphs are captured "
        "per split, not (none|mps|cpu)",
    ):
        plan_partitions(kind, device, 1, True, [0, 1], tmp_path, cublas_sm_target=True)
    assert (
        plan_partitions("green", "cuda", 1, True, [0], tmp_path, cublas_sm_target=True)[0]
        == "green"
    )


def test_none_with_a_prefill_thread_is_one_process_with_no_split(tmp_path: Path) -> None:
    part = plan_partitions("none", "cpu", 1, True, [0, 1], tmp_path, prefill_worker="thread")[1][0]
    assert (
        part.prefill_thread
        and not part.runtime_shares
        and "two streams with no split" in part.describe()
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_auto_picks_mps_where_it_is_installed_else_says_why(tmp_path: Path) -> None:
    kind, parts, daemon = plan_partitions("auto", "cuda", 1, True, [0, 1], tmp_path)
    assert kind in ("mps", "green", "none") and parts[0].why
    if kind == "mps":
        assert daemon is not None and dict(parts[0].env)["CUDA_MPS_PIPE_DIRECTORY"]


def test_a_units_shape_is_decided_by_its_policy_and_partition_alone(tmp_path: Path) -> None:
    """Where a unit's prefill worker runs: nowhere under aggregated (whatever the partition), a
    thread of the decode worker's process where the partition made it one (green, or
    --prefill-worker thread), else its own process."""
    from engine.engine import EngineConfig
    from scheduler.config import UnitConfig

    _, (cpu,), _ = plan_partitions("cpu", "cpu", 1, True, [0, 1], tmp_path)
    _, (thread,), _ = plan_partitions(
        "none", "cuda", 1, True, [0], tmp_path, prefill_worker="thread"
    )
    engine = EngineConfig(model=str(tmp_path))
    shapes = {
        (policy, part.backend, part.prefill_thread): UnitConfig(
            engine, policy=policy, partition=part
        ).prefill_worker
        for policy in ("ppd", "pd", "dlocal", "aggregated")
        for part in (cpu, thread)
    }
    assert {key: shape for key, shape in shapes.items() if key[0] != "aggregated"} == {
        (policy, backend, threaded): "thread" if threaded else "process"
        for policy in ("ppd", "pd", "dlocal")
        for backend, threaded in (("cpu", False), ("none", True))
    }
    assert {shape for key, shape in shapes.items() if key[0] == "aggregated"} == {"none"}


def test_what_a_share_manager_may_split_comes_from_the_backend(tmp_path: Path) -> None:
    """The cpu backend offers its unit's cores (any count for decode, switches not free); one core,
    or a backend whose shares are fixed at start, offers nothing."""
    from partition.backends import backend_of

    _, (two,), _ = plan_partitions("cpu", "cpu", 1, True, [0, 1], tmp_path)
    space = backend_of(two).shares(two, None)
    assert (space.units, space.start, space.sizes, space.free_switches, space.what) == (
        (0, 1),
        ((0,), (1,)),
        None,
        False,
        "cores",
    )
    _, (one,), _ = plan_partitions("cpu", "cpu", 1, True, [0], tmp_path)
    _, (none,), _ = plan_partitions("none", "cuda", 1, True, [0], tmp_path)
    assert backend_of(one).shares(one, None) is None and backend_of(none).shares(none, None) is None


def test_a_unit_without_a_prefill_worker_is_described_with_its_one_worker(tmp_path: Path) -> None:
    """The start log of an aggregated unit names no prefill share (there is no prefill worker to
    have one)."""
    _, (alone,), _ = plan_partitions("cpu", "cpu", 1, False, [0, 1], tmp_path)
    assert alone.describe() == "cpu (one worker: cores 0,1)"
    _, (split,), _ = plan_partitions("cpu", "cpu", 1, True, [0, 1], tmp_path)
    assert split.describe() == "cpu (decode: cores 0; prefill: cores 1)"
