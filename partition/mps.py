"""The MPS control daemon at run time: the one a server uses (one that runs, or its own in a private
pipe directory), starting and stopping ours, and checking that a CUDA client really runs under it.
`ppd probe` (probe_mps.py) uses the same machinery to report on MPS; `--partition mps` (backends.py)
to serve under it.

Our daemon gets a private CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, so no other process
connects to it, and every command we send (`echo CMD | nvidia-cuda-mps-control` with that
environment) reaches our daemon alone: a daemon we did not start is only looked at (its pipe
directory and /proc), never sent anything. Stopping ours sends "quit", then SIGTERM/SIGKILL to the
processes it knows are ours. Every subprocess has a timeout, so a wedged daemon cannot hang
anything.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partition import PartitionError
from partition.child import SPAWN, Env, Finding, error_text, failed, finish_child, start_child
from partition.driver import mps_enabled, nvml_processes
from partition.processes import process_alive

log = logging.getLogger("ppd.partition")

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon into its pipe directory
COMMAND_TIMEOUT_S = 15.0
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


@dataclass
class Daemon:
    """Our control daemon: its environment, its pid, and the server pids it reported."""

    binary: str
    pipe_dir: Path
    log_dir: Path
    pid: int | None = None
    server_pids: set[int] = field(default_factory=set)

    @property
    def env(self) -> dict[str, str]:
        """What points a client or a command at this daemon."""
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def command(self, text: str) -> str:
        """Send one control command to our daemon; its answer (stdout), or an exception."""
        done = subprocess.run(
            [self.binary],
            input=text + "\n",
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            timeout=COMMAND_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"'{text}' exited with {done.returncode}: {(done.stderr or done.stdout).strip()}"
            )
        return done.stdout.strip()

    def servers(self) -> list[int]:
        pids = _pid_lines(self.command("get_server_list"))
        self.server_pids.update(pids)
        return pids

    def log_tail(self, lines: int = 20) -> dict[str, str]:
        return {
            path.name: "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in sorted(self.log_dir.glob("*"))
            if path.is_file()
        }


def start_daemon(daemon: Daemon) -> Finding:
    """`nvidia-cuda-mps-control -d` with our pipe and log directories; ok once its pid file names a
    live process that answers get_server_list."""
    daemon.pipe_dir.mkdir(parents=True, exist_ok=True)
    daemon.log_dir.mkdir(parents=True, exist_ok=True)
    # Output to a file, not a pipe: a daemon that keeps an inherited pipe open would make us wait
    # for its exit.
    with open(daemon.log_dir / "start.out", "w") as out:
        try:
            code = subprocess.run(
                [daemon.binary, "-d"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **daemon.env},
                timeout=START_TIMEOUT_S,
            ).returncode
        except Exception as exc:
            return failed(f"{CONTROL} -d: {error_text(exc)}", logs=daemon.log_tail())
    if code != 0:
        return failed(f"{CONTROL} -d exited with {code}", logs=daemon.log_tail())
    daemon.pid = _wait_for_pid(daemon.pipe_dir / PID_FILE, START_TIMEOUT_S)
    if daemon.pid is None or not process_alive(daemon.pid):
        return failed(f"no live daemon behind {daemon.pipe_dir / PID_FILE}", logs=daemon.log_tail())
    try:
        servers = daemon.servers()
    except Exception as exc:
        return failed(
            f"the daemon does not answer: {error_text(exc)}", pid=daemon.pid, logs=daemon.log_tail()
        )
    return {
        "ok": True,
        "error": None,
        "pid": daemon.pid,
        "pipe_directory": str(daemon.pipe_dir),
        "servers": servers,
    }


def check_client(
    daemon: Daemon,
    device: int,
    nvml_index: int | None,
    extra_env: Env,
    timeout: float = COMMAND_TIMEOUT_S * 4,
) -> Finding:
    """Start a CUDA client with our daemon's environment and, while it holds its context, ask three
    witnesses whether it is an MPS client: the driver (in the client), our daemon's client list,
    NVML's MPS process list."""
    ready, release = SPAWN.Event(), SPAWN.Event()
    child = start_child(
        mps_client,
        (device, ready, release, timeout),
        {**daemon.env, **extra_env},
        name="mps-client",
    )
    seen: Finding = {}
    try:
        if ready.wait(timeout):
            seen = _witnesses(daemon, nvml_index, child.process.pid)
    finally:
        release.set()
        found = finish_child(child, timeout)
    found.update(seen)
    found["is_mps_client"] = bool(
        found.get("ok")
        and (
            found.get("mps_enabled")
            or seen.get("in_daemon_client_list")
            or seen.get("in_nvml_mps_list")
        )
    )
    return found


def _witnesses(daemon: Daemon, nvml_index: int | None, pid: int | None) -> Finding:
    seen: Finding = {}
    try:
        clients = {
            server: _pid_lines(daemon.command(f"get_client_list {server}"))
            for server in daemon.servers()
        }
        seen.update(
            daemon_clients=clients,
            in_daemon_client_list=any(pid in pids for pids in clients.values()),
        )
    except Exception as exc:
        seen["daemon_clients"] = error_text(exc)
    listed = nvml_processes(nvml_index, mps=True)
    seen.update(
        nvml_mps_processes=listed,
        in_nvml_mps_list=isinstance(listed, list) and any(p["pid"] == pid for p in listed),
    )
    return seen


def mps_client(device: int, ready: Any, release: Any, hold_s: float) -> Finding:
    """Runs in a child: make a CUDA context, report what it sees, hold it until released (or
    hold_s)."""
    try:
        import torch

        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
        found = {
            "pid": os.getpid(),
            "mps_enabled": mps_enabled(device),
            "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
            "thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        }
    finally:
        ready.set()  # also on failure, so the parent does not wait in vain
    found["released_in_time"] = release.wait(hold_s)
    return found


def stop_daemon(daemon: Daemon) -> Finding:
    """quit, wait, then SIGTERM and SIGKILL to the daemon and servers we know are ours (pids from
    our pid file and our daemon's answers, and still running an nvidia-cuda-mps program); stopped
    = none is left."""
    ours = {daemon.pid, *daemon.server_pids} - {None}
    try:
        ours.update(daemon.servers())
    except Exception:
        pass  # a daemon that never started or no longer answers: the pids we know are all there is
    found: Finding = {"pids": sorted(ours), "signalled": []}
    try:
        found["quit"] = daemon.command("quit") or "ok"
    except Exception as exc:
        found["quit"] = error_text(exc)
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for pid in still_running(ours):
                os.kill(pid, sig)
                found["signalled"].append(f"{pid}:{sig.name}")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while still_running(ours) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not still_running(ours):
            break
    found["still_running"] = still_running(ours)
    found["stopped"] = not found["still_running"]
    found["ok"] = found["stopped"]
    found["error"] = None if found["stopped"] else f"still running: {found['still_running']}"
    return found


def _wait_for_pid(path: Path, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = read_pid(path)
        if pid is not None:
            return pid
        time.sleep(0.1)
    return None


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def still_running(pids: set[int]) -> list[int]:
    """Those of pids still running an MPS program: a pid reused by anything else is not ours to
    signal."""
    return sorted(pid for pid in pids if process_alive(pid) and mps_program(pid))


def _pid_lines(answer: str) -> list[int]:
    """The pids in a control command's answer: lines of nothing but pids, never digits inside a
    message."""
    return [
        int(pid)
        for line in answer.splitlines()
        if re.fullmatch(r"[\d\s]+", line)
        for pid in line.split()
    ]


def mps_program(pid: int) -> str | None:
    """The nvidia-cuda-mps-* program a process runs (argv[0], or argv[1] behind an interpreter),
    else None. /proc/PID/comm would not do: it is cut at 15 characters, which makes control and
    server look alike."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
    except OSError:
        return None
    names = [os.path.basename(arg.decode(errors="replace")) for arg in argv]
    return next((name for name in names if name.startswith("nvidia-cuda-mps")), None)


# ---- a server's daemon ---------------------------------------------------------------------------


@dataclass
class MpsDaemonPlan:
    """The MPS daemon a server uses: an existing one (pipe_dir), or one to start (start=True) and
    stop at exit."""

    binary: str | None
    pipe_dir: Path
    log_dir: Path
    start: bool
    why: str
    env: dict[str, str] = field(default_factory=dict)


def existing_mps_pipe_dir() -> Path | None:
    """The pipe directory of an MPS control daemon that runs now (its pid file names a live
    process), else None."""
    pipe_dir = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR))
    pid = read_pid(pipe_dir / PID_FILE)
    return pipe_dir if pid is not None and process_alive(pid) else None


def mps_daemon_plan(workdir: Path) -> MpsDaemonPlan:
    """Use the daemon that runs, else start our own in workdir (a private pipe directory: no other
    process's clients reach it, and stopping it touches nothing else)."""
    binary = shutil.which(CONTROL)
    running = existing_mps_pipe_dir()
    if running is not None:
        log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
        return MpsDaemonPlan(
            binary,
            running,
            log_dir,
            start=False,
            why=f"using the MPS daemon at {running}",
            env={"CUDA_MPS_PIPE_DIRECTORY": str(running)},
        )
    if binary is None:
        return MpsDaemonPlan(
            None,
            workdir / "mps-pipe",
            workdir / "mps-log",
            start=False,
            why="no MPS daemon runs and nvidia-cuda-mps-control is not on PATH",
        )
    pipe_dir, log_dir = workdir / "mps-pipe", workdir / "mps-log"
    return MpsDaemonPlan(
        binary,
        pipe_dir,
        log_dir,
        start=True,
        why=f"starting an MPS daemon in {pipe_dir}",
        env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)},
    )


class MpsDaemon:
    """The MPS control daemon the server started: start and stop it (the probe's machinery
    above)."""

    def __init__(self, plan: MpsDaemonPlan) -> None:
        self.plan = plan
        self.daemon = Daemon(plan.binary or CONTROL, plan.pipe_dir, plan.log_dir)
        self.stopped = False

    def start(self) -> None:
        found = start_daemon(self.daemon)
        if not found["ok"]:
            self.stop()  # it may have half-started
            raise PartitionError(
                f"--partition mps: the MPS daemon did not start ({found['error']}); run "
                f"`ppd probe` to see why, or use --partition none"
            )
        log.info("MPS daemon started (pid %s, pipe directory %s)", found["pid"], self.plan.pipe_dir)

    def stop(self) -> None:
        """Stop it (once; later calls do nothing)."""
        if self.stopped:
            return
        self.stopped = True
        found = stop_daemon(self.daemon)
        if found["stopped"]:
            log.info("MPS daemon stopped")
        else:
            log.error("the MPS daemon we started did not stop: %s", found["error"])


def check_mps_client(plan: MpsDaemonPlan, timeout: float = 60.0) -> None:
    """PartitionError unless a CUDA client started with plan's environment runs as an MPS client.
    The control daemon starts its server only when the first client connects, so a daemon that
    started may still fail there (a VM whose device MPS cannot drive), and a client that cannot
    reach it runs time-sliced: found out now, in a child with a timeout, rather than by workers
    that crash, restart and never come up, or hang."""
    found = check_client(
        Daemon(plan.binary or CONTROL, plan.pipe_dir, plan.log_dir), 0, None, {}, timeout
    )
    if not found["is_mps_client"]:
        why = found.get("error") or "neither the driver, the daemon nor NVML counts it as one"
        raise PartitionError(
            f"--partition mps: a CUDA client of the MPS daemon at {plan.pipe_dir} does not run as "
            "an "
            f"MPS client ({why}); run `ppd probe` to see why, or use --partition none"
        )
