"""Compute shares for a unit's two workers: one interface, several backends (`ppd serve --partition`).

- cpu: each worker pinned to its own cores (the CPU stand-in for SM shares). Shares change at run time: the
  decode worker's share manager (partition/manager.py) repins itself and tells the prefill worker its cores.
- mps: the workers are clients of an MPS control daemon: the one already running, or one the server starts in
  its own pipe directory (and stops when it exits). Each worker's share caps its SMs by
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, fixed when the worker starts. A client that cannot reach the daemon silently
  runs without MPS, so each worker checks that it is an MPS client once its engine is on the GPU, and the log
  and /health say so when it is not.
- green: one process per unit, the prefill worker a thread of the decode worker's process, each on its own stream
  of a green context (partition/green.py): SM splits made once at start (decode on 32, 64 or 96 of an H100's 132
  SMs, prefill on the rest, by default), and ordinary streams when a side is alone. The share manager picks one
  per step; decode graphs are captured once per split. Green contexts split SMs only inside a process, so this is
  the mode that overlaps prefill and decode on a GPU host without MPS. If the green contexts cannot be made, the
  unit goes on with two ordinary streams (overlapping, with no SM split), and /health says why.
- none: no partition. On a GPU the two worker processes are then time-sliced (their kernels never overlap): the
  baseline, labelled as such wherever it is reported. With --prefill-worker thread, the two workers are two
  streams of one process instead, which the GPU overlaps with no split (and the CPU runs as two threads).
- auto (the default): cpu on the CPU; on a GPU mps when a daemon runs or nvidia-cuda-mps-control is installed,
  else green when cuda-python can make green contexts, else none; the log says which and why.

Not built: green contexts inside the two MPS processes (each worker on its own side of one split), which waits
for `ppd probe` on a GPU host to show that green contexts partition anything inside MPS clients.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from partition.cpu import pin_to_cores, split_cores

log = logging.getLogger("ppd.partition")

BACKENDS = ("cpu", "mps", "green", "none")
PREFILL_WORKERS = ("auto", "process", "thread")
ROLES = ("decode", "prefill")
DEFAULT_MPS_DECODE_PERCENT = 100  # a cap, not a reservation: decode may use every SM when prefill leaves them
DEFAULT_MPS_PREFILL_PERCENT = 80  # Semi-PD's defaults: prefill never takes the whole GPU from decode


class PartitionError(ValueError):
    """A partition that cannot be set up; the message says why and what to do."""


@dataclass(frozen=True)
class Share:
    """One worker's compute share."""

    cores: tuple[int, ...] = ()  # cpu: the worker's cores (empty: not pinned)
    mps_percent: int | None = None  # mps: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE

    def describe(self) -> str:
        if self.cores:
            return f"cores {','.join(map(str, self.cores))}"
        return f"{self.mps_percent}% of the SMs" if self.mps_percent is not None else "the whole device"


@dataclass(frozen=True)
class UnitPartition:
    """How one unit's device is split between its workers: the backend, each worker's share at start, and what
    both workers' environment needs before CUDA starts (the MPS daemon's pipe directory)."""

    backend: str = "none"
    decode: Share = Share()
    prefill: Share = Share()
    env: tuple[tuple[str, str], ...] = ()
    cores: tuple[int, ...] = ()  # cpu: every core of the unit, what the share manager splits at run time
    why: str = ""  # one line for the log: why this backend
    prefill_thread: bool = False  # the prefill worker is a thread of the decode worker's process (green, or asked for)
    green_sms: tuple[int, ...] = ()  # green: decode's SM count in each split (empty: a quarter, half, three quarters)

    def share(self, role: str) -> Share:
        return self.decode if role == "decode" else self.prefill

    @property
    def runtime_shares(self) -> bool:
        """Whether shares can change while the workers run: core pinning, and the choice among green splits."""
        return (self.backend == "cpu" and len(self.cores) > 1) or self.backend == "green"

    def describe(self) -> str:
        if self.backend == "none":
            return ("none (the prefill worker is a thread: two streams with no split)" if self.prefill_thread
                    else "none (the workers time-share the device)")
        if self.backend == "green":
            counts = ",".join(map(str, self.green_sms)) or "a quarter, half, three quarters"
            return f"green (one process; decode on {counts} SMs by step, prefill on the rest)"
        return f"{self.backend} (decode: {self.decode.describe()}; prefill: {self.prefill.describe()})"


@dataclass
class MpsDaemonPlan:
    """The MPS daemon a server uses: an existing one (pipe_dir), or one to start (start=True) and stop at exit."""

    binary: str | None
    pipe_dir: Path
    log_dir: Path
    start: bool
    why: str
    env: dict[str, str] = field(default_factory=dict)


# ---- planning, in the launcher (before any worker starts) ---------------------------------------------------------


def plan_partitions(kind: str, device: str, num_units: int, with_prefill: bool, cores: list[int],
                    workdir: Path, mps_shares: tuple[int, int] | None = None, prefill_worker: str = "auto",
                    green_sms: tuple[int, ...] = ()) -> tuple[str, list[UnitPartition], MpsDaemonPlan | None]:
    """(the backend chosen, each unit's partition, the MPS daemon to use or start). kind is --partition,
    prefill_worker --prefill-worker, green_sms --green-decode-sms."""
    if prefill_worker not in PREFILL_WORKERS:
        raise PartitionError(f"--prefill-worker {prefill_worker}: not one of {', '.join(PREFILL_WORKERS)}")
    if kind == "auto":
        kind, why = auto_backend(device, with_prefill)
    else:
        why = f"--partition {kind}"
    if prefill_worker == "thread" and not with_prefill:
        raise PartitionError("--prefill-worker thread: --policy aggregated runs no prefill worker")
    if prefill_worker == "thread" and kind in ("cpu", "mps"):
        raise PartitionError(f"--prefill-worker thread with --partition {kind}: {kind} shares are per process; "
                             "use --partition green (GPU) or none with a prefill thread")
    if green_sms and kind != "green":
        raise PartitionError(f"--green-decode-sms is for --partition green, not {kind}")
    if kind == "green":
        return kind, [plan_green(device, with_prefill, prefill_worker, green_sms, why)] * num_units, None
    if kind == "cpu":
        if device != "cpu":
            raise PartitionError("--partition cpu pins CPU workers to cores; on GPUs use --partition mps, none or auto")
        units = [UnitPartition("cpu", Share(d), Share(p), cores=tuple(dict.fromkeys(d + p)), why=why)
                 for d, p in split_cores(cores, num_units, with_prefill)]
        return kind, units, None
    if kind == "none":
        return kind, [UnitPartition("none", why=why, prefill_thread=prefill_worker == "thread")] * num_units, None
    if kind == "mps":
        if device == "cpu":
            raise PartitionError("--partition mps needs a GPU; on the CPU use --partition cpu (or auto)")
        daemon = mps_daemon_plan(workdir)
        if daemon.binary is None and not daemon.env:
            raise PartitionError(f"--partition mps: {daemon.why}; install the CUDA toolkit's nvidia-cuda-mps-control "
                                 "or start a daemon (nvidia-cuda-mps-control -d), or use --partition none")
        decode_pct, prefill_pct = mps_shares or (DEFAULT_MPS_DECODE_PERCENT, DEFAULT_MPS_PREFILL_PERCENT)
        for name, pct in (("decode", decode_pct), ("prefill", prefill_pct)):
            if not 1 <= pct <= 100:
                raise PartitionError(f"--mps-{name}-percent {pct}: a percentage of the SMs, 1 to 100")
        env = tuple(sorted(daemon.env.items()))
        part = UnitPartition("mps", Share(mps_percent=decode_pct), Share(mps_percent=prefill_pct) if with_prefill
                             else Share(), env=env, why=f"{why}: {daemon.why}")
        return kind, [part] * num_units, daemon
    raise PartitionError(f"--partition {kind}: not one of auto, {', '.join(BACKENDS)}")


def plan_green(device: str, with_prefill: bool, prefill_worker: str, green_sms: tuple[int, ...],
               why: str) -> UnitPartition:
    if device == "cpu":
        raise PartitionError("--partition green splits a GPU's SMs; on the CPU use --partition cpu (or auto)")
    if not with_prefill:
        raise PartitionError("--partition green: --policy aggregated runs no prefill worker, there is nothing to "
                             "split; use --partition none")
    if prefill_worker == "process":
        raise PartitionError("--partition green with --prefill-worker process: green contexts split SMs only "
                             "inside one process; leave --prefill-worker at auto (a thread)")
    if not green_available():
        raise PartitionError("--partition green makes green contexts with cuda-python's driver API, which is not "
                             "installed: pip install cuda-python, or use --partition mps or none")
    from partition.green import check_decode_sms

    try:
        counts = check_decode_sms(green_sms) if green_sms else ()
    except ValueError as exc:
        raise PartitionError(f"--green-decode-sms: {exc}") from exc
    return UnitPartition("green", why=why, prefill_thread=True, green_sms=counts)


def green_available() -> bool:
    """Whether cuda-python's driver API, with green contexts (CUDA 12.4 and later), can be imported here."""
    from partition.probe_gpus import cuda_driver

    try:
        return hasattr(cuda_driver(), "cuGreenCtxCreate")
    except ImportError:
        return False


def auto_backend(device: str, with_prefill: bool = True) -> tuple[str, str]:
    """The backend --partition auto picks on this host, and why."""
    if device == "cpu":
        return "cpu", "auto: on the CPU each worker gets its own cores"
    running = existing_mps_pipe_dir()
    if running is not None:
        return "mps", f"auto: an MPS daemon runs (pipe directory {running})"
    if shutil.which("nvidia-cuda-mps-control"):
        return "mps", "auto: nvidia-cuda-mps-control is installed, the server starts its own MPS daemon"
    if with_prefill and green_available():
        return "green", ("auto: no MPS on this host, so each unit is one process: the prefill worker is a thread of "
                         "the decode worker's, on green-context SM splits")
    return "none", ("auto: no MPS on this host (no daemon runs and nvidia-cuda-mps-control is not installed) and no "
                    "cuda-python for green contexts, so the workers are time-sliced on each GPU: install MPS, or "
                    "pip install cuda-python, for overlap")


def existing_mps_pipe_dir() -> Path | None:
    """The pipe directory of an MPS control daemon that runs now (its pid file names a live process), else None."""
    from partition.probe_mps import DEFAULT_PIPE_DIR, PID_FILE, read_pid
    from partition.processes import process_alive

    pipe_dir = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR))
    pid = read_pid(pipe_dir / PID_FILE)
    return pipe_dir if pid is not None and process_alive(pid) else None


def mps_daemon_plan(workdir: Path) -> MpsDaemonPlan:
    """Use the daemon that runs, else start our own in workdir (a private pipe directory: no other process's
    clients reach it, and stopping it touches nothing else)."""
    binary = shutil.which("nvidia-cuda-mps-control")
    running = existing_mps_pipe_dir()
    if running is not None:
        log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
        return MpsDaemonPlan(binary, running, log_dir, start=False, why=f"using the MPS daemon at {running}",
                             env={"CUDA_MPS_PIPE_DIRECTORY": str(running)})
    if binary is None:
        return MpsDaemonPlan(None, workdir / "mps-pipe", workdir / "mps-log", start=False,
                             why="no MPS daemon runs and nvidia-cuda-mps-control is not on PATH")
    pipe_dir, log_dir = workdir / "mps-pipe", workdir / "mps-log"
    return MpsDaemonPlan(binary, pipe_dir, log_dir, start=True, why=f"starting an MPS daemon in {pipe_dir}",
                         env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)})


class MpsDaemon:
    """The MPS control daemon the server started (start/stop), by the probe's tested machinery."""

    def __init__(self, plan: MpsDaemonPlan) -> None:
        from partition.probe_mps import Daemon

        self.plan = plan
        self.daemon = Daemon(plan.binary or "nvidia-cuda-mps-control", plan.pipe_dir, plan.log_dir)
        self.stopped = False

    def start(self) -> None:
        from partition.probe_mps import start_daemon

        found = start_daemon(self.daemon)
        if not found["ok"]:
            self.stop()  # it may have half-started
            raise PartitionError(f"--partition mps: the MPS daemon did not start ({found['error']}); run "
                                 f"`ppd probe` to see why, or use --partition none")
        log.info("MPS daemon started (pid %s, pipe directory %s)", found["pid"], self.plan.pipe_dir)

    def stop(self) -> None:
        """Stop it (once; later calls do nothing)."""
        from partition.probe_mps import stop_daemon

        if self.stopped:
            return
        self.stopped = True
        found = stop_daemon(self.daemon)
        if found["stopped"]:
            log.info("MPS daemon stopped")
        else:
            log.error("the MPS daemon we started did not stop: %s", found["error"])


def check_mps_client(plan: MpsDaemonPlan, timeout: float = 60.0) -> None:
    """PartitionError unless a CUDA client started with plan's environment runs as an MPS client. The control daemon
    starts its server only when the first client connects, so a daemon that started may still fail there (a VM whose
    device MPS cannot drive), and a client that cannot reach it runs time-sliced: found out now, in a child with a
    timeout, rather than by workers that crash, restart and never come up, or hang."""
    from partition.probe_mps import CONTROL, Daemon, check_client

    found = check_client(Daemon(plan.binary or CONTROL, plan.pipe_dir, plan.log_dir), 0, None, {}, timeout)
    if not found["is_mps_client"]:
        why = found.get("error") or "neither the driver, the daemon nor NVML counts it as one"
        raise PartitionError(f"--partition mps: a CUDA client of the MPS daemon at {plan.pipe_dir} does not run as an "
                             f"MPS client ({why}); run `ppd probe` to see why, or use --partition none")


# ---- in a worker ---------------------------------------------------------------------------------------------------


def apply_at_start(part: UnitPartition, role: str) -> None:
    """In a worker, before anything touches CUDA: the daemon's environment, the thread percentage, the cores."""
    os.environ.update(dict(part.env))
    share = part.share(role)
    if share.mps_percent is not None:
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share.mps_percent)
    pin_to_cores(share.cores)


def check_in_worker(part: UnitPartition, device: str) -> str | None:
    """In a worker whose engine is on its device: why its partition does not hold (None: it does)."""
    if part.backend != "mps" or not device.startswith("cuda"):
        return None
    from partition.probe_gpus import mps_enabled

    enabled = mps_enabled(0)
    if enabled is False:
        return (f"this worker is not an MPS client (it could not reach the daemon at "
                f"{dict(part.env).get('CUDA_MPS_PIPE_DIRECTORY', '/tmp/nvidia-mps')}): its kernels are time-sliced "
                "with the other worker's; check that the daemon runs as this user, or use --partition none")
    if enabled is None:
        return "cannot tell whether this worker is an MPS client (the driver does not say)"
    return None
