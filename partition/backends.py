"""Compute shares for a unit's two workers: one interface, several backends (`ppd serve
--partition`).

- cpu: each worker pinned to its own cores (the CPU stand-in for SM shares). Shares change at run
  time: the decode worker's share manager (partition/manager.py) repins itself and tells the prefill
  worker its cores.
- mps: the workers are clients of an MPS control daemon: the one already running, or one the server
  starts in its own pipe directory (and stops when it exits). Each worker's share caps its SMs by
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, fixed when the worker starts. A client that cannot reach the
  daemon silently runs without MPS, so each worker checks that it is an MPS client once its engine
  is on the GPU, and the log and /health say so when it is not.
- green: one process per unit, the prefill worker a thread of the decode worker's process, each on
  its own stream of a green context (partition/green.py): SM splits made once at start (decode on
  32, 64 or 96 of an H100's 132 SMs, prefill on the rest, by default), and ordinary streams when a
  side is alone. The share manager picks one per step; decode graphs are captured once per split.
  Green contexts split SMs only inside a process, so this is the mode that overlaps prefill and
  decode on a GPU host without MPS. If the green contexts cannot be made, the unit goes on with two
  ordinary streams (overlapping, with no SM split), and /health says why.
- none: no partition. On a GPU the two worker processes are then time-sliced (their kernels never
  overlap): the baseline, labelled as such wherever it is reported. With --prefill-worker thread,
  the two workers are two streams of one process instead, which the GPU overlaps with no split (and
  the CPU runs as two threads).
- auto (the default): cpu on the CPU; on a GPU mps when a daemon runs or nvidia-cuda-mps-control is
  installed, else green when cuda-python can make green contexts, else none; the log says which and
  why.

Not built: green contexts inside the two MPS processes (each worker on its own side of one split),
which waits for `ppd probe` on a GPU host to show that green contexts partition anything inside MPS
clients.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from partition import PartitionError
from partition.cpu import pin_to_cores, split_cores

if TYPE_CHECKING:
    from partition.green import StreamSplits
    from partition.mps import MpsDaemonPlan

PREFILL_WORKERS = ("auto", "process", "thread")
DEFAULT_MPS_DECODE_PERCENT = (
    100  # a cap, not a reservation: decode may use every SM when prefill leaves them
)
DEFAULT_MPS_PREFILL_PERCENT = (
    80  # Semi-PD's defaults: prefill never takes the whole GPU from decode
)


@dataclass(frozen=True)
class Share:
    """One worker's compute share."""

    cores: tuple[int, ...] = ()  # cpu: the worker's cores (empty: not pinned)
    mps_percent: int | None = None  # mps: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE

    def describe(self) -> str:
        if self.cores:
            return f"cores {','.join(map(str, self.cores))}"
        return (
            f"{self.mps_percent}% of the SMs"
            if self.mps_percent is not None
            else "the whole device"
        )


@dataclass(frozen=True)
class UnitPartition:
    """How one unit's device is split between its workers: the backend, each worker's share at
    start, and what both workers' environment needs before CUDA starts (the MPS daemon's pipe
    directory)."""

    backend: str = "none"
    decode: Share = Share()
    prefill: Share = Share()
    env: tuple[tuple[str, str], ...] = ()
    cores: tuple[
        int, ...
    ] = ()  # cpu: every core of the unit, what the share manager splits at run time
    why: str = ""  # one line for the log: why this backend
    prefill_thread: bool = (
        False  # the prefill worker is a thread of the decode worker's process (green, or asked for)
    )
    green_sms: tuple[
        int, ...
    ] = ()  # green: decode's SM count in each split (empty: a quarter, half, three quarters)

    def share(self, role: str) -> Share:
        return self.decode if role == "decode" else self.prefill

    @property
    def runtime_shares(self) -> bool:
        """Whether shares can change while the workers run: core pinning, and the choice among green
        splits."""
        return backend_of(self).runtime_shares(self)

    def describe(self) -> str:
        return backend_of(self).describe(self)


# ---- the backends: one interface -----------------------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """What planning a partition needs from the command line and the host."""

    device: str
    num_units: int
    with_prefill: bool  # the units have a prefill worker (every policy but aggregated)
    cores: tuple[int, ...] = ()  # the CPU cores this server may use
    workdir: Path = Path(
        "/tmp"
    )  # the server's private folder (an MPS daemon's pipe directory goes there)
    mps_shares: tuple[int, int] | None = None  # --mps-decode-percent, --mps-prefill-percent
    prefill_worker: str = "auto"  # --prefill-worker
    green_sms: tuple[int, ...] = ()  # --green-decode-sms


@dataclass(frozen=True)
class ShareSpace:
    """What a share manager (manager.py) splits at run time: its units (cores, or SM indices), the
    split the workers start on, the shares decode may have (None: any count), whether a switch is
    free."""

    units: tuple[int, ...]
    start: tuple[tuple[int, ...], tuple[int, ...]]  # (decode's units, prefill's units)
    sizes: tuple[int, ...] | None
    free_switches: bool
    what: str  # "cores" or "SMs", for the log


class Backend:
    """One way a unit's two workers share its device. The launcher plans it before any worker
    starts; each worker applies its share before anything touches CUDA and checks it once its
    engine is on the device; the decode worker asks it what a share manager may split; /health
    reports it."""

    name = ""
    shares_per_process = (
        False  # each worker's share is its own process's (so no prefill thread can have one)
    )
    manages_by_default = (
        False  # a share manager runs unless --no-share-manager (else only with --share-manager)
    )

    def plan(self, req: PlanRequest, why: str) -> tuple[list[UnitPartition], MpsDaemonPlan | None]:
        """Each unit's partition, and the MPS daemon to use or start (None: none); PartitionError if
        it cannot be."""
        raise NotImplementedError

    def apply(self, part: UnitPartition, role: str) -> None:
        """In worker `role`, before anything touches CUDA."""

    def check(self, part: UnitPartition, device: str) -> str | None:
        """In a worker whose engine is on its device: why its partition does not hold (None: it
        does)."""
        return None

    def runtime_shares(self, part: UnitPartition) -> bool:
        """Whether this partition's shares can change while the workers run."""
        return False

    def shares(self, part: UnitPartition, streams: StreamSplits | None) -> ShareSpace | None:
        """What a share manager may split at run time (streams: the decode worker's green-context
        splits, if any); None where shares are fixed once the workers start."""
        return None

    def streams(self, part: UnitPartition) -> tuple[StreamSplits, str | None]:
        """A one-process unit's streams on a GPU (decode, and the prefill thread beside it), and why
        the partition does not hold (None: it does): two ordinary streams, which overlap with no
        split. On the current device, after torch's primary context is made."""
        from partition.green import StreamSplits

        return StreamSplits.plain(), None

    def describe(self, part: UnitPartition) -> str:
        if (
            part.prefill == Share() and part.decode != Share()
        ):  # aggregated: the decode worker is the unit's one
            return f"{self.name} (one worker: {part.decode.describe()})"
        return f"{self.name} (decode: {part.decode.describe()}; prefill: {part.prefill.describe()})"

    def stats(self, part: UnitPartition) -> dict:
        """The partition as /health reports it before the workers add their live shares."""
        return {"backend": self.name}


class CpuBackend(Backend):
    """Each worker pinned to its own cores; a share manager moves cores between them at run time."""

    name = "cpu"
    shares_per_process = True

    def plan(self, req: PlanRequest, why: str) -> tuple[list[UnitPartition], MpsDaemonPlan | None]:
        if req.device != "cpu":
            raise PartitionError(
                "--partition cpu pins CPU workers to cores; on GPUs use --partition mps, none or "
                "auto"
            )
        return [
            UnitPartition("cpu", Share(d), Share(p), cores=tuple(dict.fromkeys(d + p)), why=why)
            for d, p in split_cores(list(req.cores), req.num_units, req.with_prefill)
        ], None

    def apply(self, part: UnitPartition, role: str) -> None:
        pin_to_cores(part.share(role).cores)

    def runtime_shares(self, part: UnitPartition) -> bool:
        return len(part.cores) > 1

    def shares(self, part: UnitPartition, streams: StreamSplits | None) -> ShareSpace | None:
        if not self.runtime_shares(part):
            return None
        return ShareSpace(part.cores, (part.decode.cores, part.prefill.cores), None, False, "cores")


class MpsBackend(Backend):
    """Both workers clients of an MPS daemon, each capped at a share of the SMs fixed when it
    starts."""

    name = "mps"
    shares_per_process = True

    def plan(self, req: PlanRequest, why: str) -> tuple[list[UnitPartition], MpsDaemonPlan | None]:
        from partition.mps import mps_daemon_plan

        if req.device == "cpu":
            raise PartitionError(
                "--partition mps needs a GPU; on the CPU use --partition cpu (or auto)"
            )
        daemon = mps_daemon_plan(req.workdir)
        if daemon.binary is None and not daemon.env:
            raise PartitionError(
                f"--partition mps: {daemon.why}; install the CUDA toolkit's "
                "nvidia-cuda-mps-control "
                "or start a daemon (nvidia-cuda-mps-control -d), or use --partition none"
            )
        decode_pct, prefill_pct = req.mps_shares or (
            DEFAULT_MPS_DECODE_PERCENT,
            DEFAULT_MPS_PREFILL_PERCENT,
        )
        for name, pct in (("decode", decode_pct), ("prefill", prefill_pct)):
            if not 1 <= pct <= 100:
                raise PartitionError(
                    f"--mps-{name}-percent {pct}: a percentage of the SMs, 1 to 100"
                )
        part = UnitPartition(
            "mps",
            Share(mps_percent=decode_pct),
            Share(mps_percent=prefill_pct) if req.with_prefill else Share(),
            env=tuple(sorted(daemon.env.items())),
            why=f"{why}: {daemon.why}",
        )
        return [part] * req.num_units, daemon

    def apply(self, part: UnitPartition, role: str) -> None:
        os.environ.update(dict(part.env))
        if (percent := part.share(role).mps_percent) is not None:
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)

    def check(self, part: UnitPartition, device: str) -> str | None:
        if not device.startswith("cuda"):
            return None
        from partition.driver import mps_enabled

        enabled = mps_enabled(0)
        if enabled is False:
            return (
                f"this worker is not an MPS client (it could not reach the daemon at "
                f"{dict(part.env).get('CUDA_MPS_PIPE_DIRECTORY', '/tmp/nvidia-mps')}): its kernels "
                "are "
                "time-sliced with the other worker's; check that the daemon runs as this user, or "
                "use "
                "--partition none"
            )
        if enabled is None:
            return "cannot tell whether this worker is an MPS client (the driver does not say)"
        return None

    def stats(self, part: UnitPartition) -> dict:
        return {
            "backend": self.name,
            "decode_percent": part.decode.mps_percent,
            "prefill_percent": part.prefill.mps_percent,
        }


class GreenBackend(Backend):
    """One process per unit, each worker on its own stream of a green context: SM splits made at
    start, one of them picked per step by the share manager."""

    name = "green"
    manages_by_default = True  # a switch is a choice of stream

    def plan(self, req: PlanRequest, why: str) -> tuple[list[UnitPartition], MpsDaemonPlan | None]:
        if req.device == "cpu":
            raise PartitionError(
                "--partition green splits a GPU's SMs; on the CPU use --partition cpu (or auto)"
            )
        if not req.with_prefill:
            raise PartitionError(
                "--partition green: --policy aggregated runs no prefill worker, there is nothing "
                "to "
                "split; use --partition none"
            )
        if req.prefill_worker == "process":
            raise PartitionError(
                "--partition green with --prefill-worker process: green contexts split SMs only "
                "inside one process; leave --prefill-worker at auto (a thread)"
            )
        if not green_available():
            raise PartitionError(
                "--partition green makes green contexts with cuda-python's driver API, which is "
                "not "
                "installed: pip install cuda-python, or use --partition mps or none"
            )
        from partition.green import check_decode_sms

        try:
            counts = check_decode_sms(req.green_sms) if req.green_sms else ()
        except ValueError as exc:
            raise PartitionError(f"--green-decode-sms: {exc}") from exc
        return [
            UnitPartition("green", why=why, prefill_thread=True, green_sms=counts)
        ] * req.num_units, None

    def runtime_shares(self, part: UnitPartition) -> bool:
        return True

    def shares(self, part: UnitPartition, streams: StreamSplits | None) -> ShareSpace | None:
        if streams is None or not streams.decode_counts():
            # no green contexts (the log and /health say why): there is nothing to choose between
            return None
        units, n = tuple(range(streams.total_sms)), streams.middle_decode_sms()
        return ShareSpace(units, (units[:n], units[n:]), streams.decode_counts(), True, "SMs")

    def streams(self, part: UnitPartition) -> tuple[StreamSplits, str | None]:
        import torch

        from partition.green import GreenError, StreamSplits, default_decode_sms

        counts = part.green_sms or default_decode_sms(
            torch.cuda.get_device_properties(0).multi_processor_count
        )
        try:
            return StreamSplits.green(counts), None  # which logs the SM counts the driver granted
        except (GreenError, ValueError) as exc:
            return StreamSplits.plain(), (
                f"green contexts could not be made ({exc}): prefill and decode run on two "
                "ordinary streams, overlapping with no SM split"
            )

    def describe(self, part: UnitPartition) -> str:
        counts = ",".join(map(str, part.green_sms)) or "a quarter, half, three quarters"
        return f"green (one process; decode on {counts} SMs by step, prefill on the rest)"


class NoneBackend(Backend):
    """No partition: two time-sliced processes on a GPU, or a prefill thread beside decode on two
    streams."""

    name = "none"

    def plan(self, req: PlanRequest, why: str) -> tuple[list[UnitPartition], MpsDaemonPlan | None]:
        return [
            UnitPartition("none", why=why, prefill_thread=req.prefill_worker == "thread")
        ] * req.num_units, None

    def describe(self, part: UnitPartition) -> str:
        return (
            "none (the prefill worker is a thread: two streams with no split)"
            if part.prefill_thread
            else "none (the workers time-share the device)"
        )


BACKENDS: dict[str, Backend] = {
    b.name: b for b in (CpuBackend(), MpsBackend(), GreenBackend(), NoneBackend())
}


def backend_of(part: UnitPartition) -> Backend:
    return BACKENDS[part.backend]


# ---- planning, in the launcher (before any worker starts) ----------------------------------------


def plan_partitions(
    kind: str,
    device: str,
    num_units: int,
    with_prefill: bool,
    cores: list[int],
    workdir: Path,
    mps_shares: tuple[int, int] | None = None,
    prefill_worker: str = "auto",
    green_sms: tuple[int, ...] = (),
    cublas_sm_target: bool = False,
) -> tuple[str, list[UnitPartition], MpsDaemonPlan | None]:
    """(the backend chosen, each unit's partition, the MPS daemon to use or start). kind is
    --partition, prefill_worker --prefill-worker, green_sms --green-decode-sms, cublas_sm_target
    --cublas-sm-target (checked here; the engine config carries it)."""
    if prefill_worker not in PREFILL_WORKERS:
        raise PartitionError(
            f"--prefill-worker {prefill_worker}: not one of {', '.join(PREFILL_WORKERS)}"
        )
    if kind == "auto":
        kind, why = auto_backend(device, with_prefill)
    elif kind in BACKENDS:
        why = f"--partition {kind}"
    else:
        raise PartitionError(f"--partition {kind}: not one of auto, {', '.join(BACKENDS)}")
    if prefill_worker == "thread" and not with_prefill:
        raise PartitionError("--prefill-worker thread: --policy aggregated runs no prefill worker")
    if prefill_worker == "thread" and BACKENDS[kind].shares_per_process:
        raise PartitionError(
            f"--prefill-worker thread with --partition {kind}: {kind} shares are per process; "
            "use --partition green (GPU) or none with a prefill thread"
        )
    if green_sms and kind != "green":
        raise PartitionError(f"--green-decode-sms is for --partition green, not {kind}")
    if cublas_sm_target and kind != "green":
        raise PartitionError(
            f"--cublas-sm-target is for --partition green, where graphs are captured per split, "
            f"not {kind}"
        )
    req = PlanRequest(
        device,
        num_units,
        with_prefill,
        tuple(cores),
        workdir,
        mps_shares,
        prefill_worker,
        green_sms,
    )
    parts, daemon = BACKENDS[kind].plan(req, why)
    return kind, parts, daemon


def green_available() -> bool:
    """Whether cuda-python's driver API, with green contexts (CUDA 12.4 and later), can be imported
    here."""
    from partition.driver import cuda_driver

    try:
        return hasattr(cuda_driver(), "cuGreenCtxCreate")
    except ImportError:
        return False


def auto_backend(device: str, with_prefill: bool = True) -> tuple[str, str]:
    """The backend --partition auto picks on this host, and why."""
    from partition.mps import CONTROL, existing_mps_pipe_dir

    if device == "cpu":
        return "cpu", "auto: on the CPU each worker gets its own cores"
    running = existing_mps_pipe_dir()
    if running is not None:
        return "mps", f"auto: an MPS daemon runs (pipe directory {running})"
    if shutil.which(CONTROL):
        return (
            "mps",
            "auto: nvidia-cuda-mps-control is installed, the server starts its own MPS daemon",
        )
    if with_prefill and green_available():
        return "green", (
            "auto: no MPS on this host, so each unit is one process: the prefill worker is a "
            "thread of "
            "the decode worker's, on green-context SM splits"
        )
    return "none", (
        "auto: no MPS on this host (no daemon runs and nvidia-cuda-mps-control is not installed) "
        "and no "
        "cuda-python for green contexts, so the workers are time-sliced on each GPU: install MPS, "
        "or "
        "pip install cuda-python, for overlap"
    )


# ---- in a worker ---------------------------------------------------------------------------------


def apply_at_start(part: UnitPartition, role: str) -> None:
    """In a worker, before anything touches CUDA: the daemon's environment, the thread percentage,
    the cores."""
    backend_of(part).apply(part, role)


def check_in_worker(part: UnitPartition, device: str) -> str | None:
    """In a worker whose engine is on its device: why its partition does not hold (None: it
    does)."""
    return backend_of(part).check(part, device)
