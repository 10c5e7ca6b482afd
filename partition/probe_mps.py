"""MPS on this host: is nvidia-cuda-mps-control there, does a daemon already run, can we run our own, and do
clients of ours really run under it.

Our daemon gets a private CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY under the probe's temp dir, so no
other process connects to it, and every command we send (`echo CMD | nvidia-cuda-mps-control` with that
environment) reaches our daemon alone: a daemon we did not start is only looked at (its pipe directory and
/proc), never sent anything. Nothing here changes the GPU (compute mode, clocks, MIG). probe_mps always stops
the daemon it started ("quit", then SIGTERM/SIGKILL to the processes it knows are ours) and reports whether it
really stopped. Every subprocess has a timeout, so a wedged daemon cannot hang the probe.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from partition.probe_child import SPAWN, Env, Finding, error_text, failed, finish_child, guarded, skipped, start_child
from partition.probe_gpus import mps_enabled, nvml_processes
from partition.processes import process_alive

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
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def command(self, text: str) -> str:
        """Send one control command to our daemon; its answer (stdout), or an exception."""
        done = subprocess.run([self.binary], input=text + "\n", capture_output=True, text=True,
                              env={**os.environ, **self.env}, timeout=COMMAND_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"'{text}' exited with {done.returncode}: {(done.stderr or done.stdout).strip()}")
        return done.stdout.strip()

    def servers(self) -> list[int]:
        pids = _pid_lines(self.command("get_server_list"))
        self.server_pids.update(pids)
        return pids

    def log_tail(self, lines: int = 20) -> dict[str, str]:
        return {path.name: "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                for path in sorted(self.log_dir.glob("*")) if path.is_file()}


def probe_mps(device: int, nvml_index: int | None, workdir: Path, under_mps: Callable[[Env], Finding]) -> Finding:
    """The MPS findings; under_mps(env) runs the IPC, overlap and green-context probes as clients of our daemon."""
    binary = shutil.which(CONTROL)
    found: Finding = {"ok": False, "error": None, "control_binary": binary, "existing": existing_daemon()}
    if binary is None:
        return {**found, "error": f"{CONTROL} is not on PATH"}
    daemon = Daemon(binary, workdir / "mps-pipe", workdir / "mps-log")
    found["static_partitioning"] = static_partitioning(daemon)
    found["daemon"] = start_daemon(daemon)
    if not found["daemon"]["ok"]:
        found["stop"] = guarded(stop_daemon, daemon)  # it may have half-started
        return {**found, "error": found["daemon"]["error"]}
    try:
        found["client"] = guarded(check_client, daemon, device, nvml_index, {})
        found["thread_percentage_50"] = guarded(check_client, daemon, device, nvml_index,
                                                {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})
        if found["client"].get("is_mps_client"):
            found["under_mps"] = guarded(under_mps, {**daemon.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None})
        else:
            found["under_mps"] = skipped("a client of our daemon did not run as an MPS client")
    finally:
        found["stop"] = guarded(stop_daemon, daemon)  # whatever happened above
    found["logs"] = daemon.log_tail()
    is_client, stopped = found["client"].get("is_mps_client"), found["stop"].get("stopped")
    error = None if is_client else "a client of our daemon did not run as an MPS client"
    if not stopped:
        error = f"our MPS daemon did not stop: {found['stop'].get('error')}"
    return {**found, "ok": bool(is_client and stopped), "error": error}


def existing_daemon() -> Finding:
    """Whether an MPS daemon or server already runs (looked at, never contacted)."""
    pipe_dir = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR))
    processes = mps_processes()
    return {"pipe_directory": str(pipe_dir), "pipe_directory_exists": pipe_dir.is_dir(),
            "control_pid_file": read_pid(pipe_dir / PID_FILE), "processes": processes, "running": bool(processes)}


def mps_processes() -> list[dict[str, Any]]:
    """Every nvidia-cuda-mps-* process on the host, from /proc."""
    pids = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return [{"pid": pid, "command": name} for pid in pids if (name := _mps_program(pid))]


def _mps_program(pid: int) -> str | None:
    """The nvidia-cuda-mps-* program a process runs (argv[0], or argv[1] behind an interpreter), else None.
    /proc/PID/comm would not do: it is cut at 15 characters, which makes control and server look alike."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
    except OSError:
        return None
    names = [os.path.basename(arg.decode(errors="replace")) for arg in argv]
    return next((name for name in names if name.startswith("nvidia-cuda-mps")), None)


def static_partitioning(daemon: Daemon) -> Finding:
    """Whether the control binary's usage mentions static SM partitions (-S / --static-partitioning); only read.
    Run with our (not yet started) pipe directory, so a stray client call can reach no other daemon."""
    texts = {}
    for flag in ("-h", "--help", "-v"):
        try:
            done = subprocess.run([daemon.binary, flag], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  env={**os.environ, **daemon.env}, timeout=COMMAND_TIMEOUT_S)
            texts[flag] = (done.stdout + done.stderr).strip()[:2000]
        except Exception as exc:
            texts[flag] = error_text(exc)
    usage = f"{texts['-h']}\n{texts['--help']}"
    offered = "--static-partitioning" in usage or re.search(r"(^|\s)-S\b", usage) is not None
    return {"offered": offered, "usage": usage, "version": texts["-v"],
            "env_CUDA_MPS_SM_PARTITION": os.environ.get("CUDA_MPS_SM_PARTITION")}


def start_daemon(daemon: Daemon) -> Finding:
    """`nvidia-cuda-mps-control -d` with our pipe and log directories; ok once its pid file names a live process
    that answers get_server_list."""
    daemon.pipe_dir.mkdir(parents=True, exist_ok=True)
    daemon.log_dir.mkdir(parents=True, exist_ok=True)
    # Output to a file, not a pipe: a daemon that keeps an inherited pipe open would make us wait for its exit.
    with open(daemon.log_dir / "start.out", "w") as out:
        try:
            code = subprocess.run([daemon.binary, "-d"], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, **daemon.env}, timeout=START_TIMEOUT_S).returncode
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
        return failed(f"the daemon does not answer: {error_text(exc)}", pid=daemon.pid, logs=daemon.log_tail())
    return {"ok": True, "error": None, "pid": daemon.pid, "pipe_directory": str(daemon.pipe_dir), "servers": servers}


def check_client(daemon: Daemon, device: int, nvml_index: int | None, extra_env: Env,
                 timeout: float = COMMAND_TIMEOUT_S * 4) -> Finding:
    """Start a CUDA client with our daemon's environment and, while it holds its context, ask three witnesses
    whether it is an MPS client: the driver (in the client), our daemon's client list, NVML's MPS process list."""
    ready, release = SPAWN.Event(), SPAWN.Event()
    child = start_child(mps_client, (device, ready, release, timeout), {**daemon.env, **extra_env}, name="mps-client")
    seen: Finding = {}
    try:
        if ready.wait(timeout):
            seen = _witnesses(daemon, nvml_index, child.process.pid)
    finally:
        release.set()
        found = finish_child(child, timeout)
    found.update(seen)
    found["is_mps_client"] = bool(found.get("ok") and (found.get("mps_enabled") or seen.get("in_daemon_client_list")
                                                       or seen.get("in_nvml_mps_list")))
    return found


def _witnesses(daemon: Daemon, nvml_index: int | None, pid: int | None) -> Finding:
    seen: Finding = {}
    try:
        clients = {server: _pid_lines(daemon.command(f"get_client_list {server}")) for server in daemon.servers()}
        seen.update(daemon_clients=clients, in_daemon_client_list=any(pid in pids for pids in clients.values()))
    except Exception as exc:
        seen["daemon_clients"] = error_text(exc)
    listed = nvml_processes(nvml_index, mps=True)
    seen.update(nvml_mps_processes=listed,
                in_nvml_mps_list=isinstance(listed, list) and any(p["pid"] == pid for p in listed))
    return seen


def mps_client(device: int, ready: Any, release: Any, hold_s: float) -> Finding:
    """Runs in a child: make a CUDA context, report what it sees, hold it until released (or hold_s)."""
    try:
        import torch

        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
        found = {"pid": os.getpid(), "mps_enabled": mps_enabled(device),
                 "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
                 "thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
    finally:
        ready.set()  # also on failure, so the parent does not wait in vain
    found["released_in_time"] = release.wait(hold_s)
    return found


def stop_daemon(daemon: Daemon) -> Finding:
    """quit, wait, then SIGTERM and SIGKILL to the daemon and servers we know are ours (pids from our pid file
    and our daemon's answers, and still running an nvidia-cuda-mps program); stopped = none is left."""
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
            for pid in _living(ours):
                os.kill(pid, sig)
                found["signalled"].append(f"{pid}:{sig.name}")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _living(ours) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _living(ours):
            break
    found["still_running"] = _living(ours)
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


def _living(pids: set[int]) -> list[int]:
    """Those of pids still running an MPS program: a pid reused by anything else is not ours to signal."""
    return sorted(pid for pid in pids if process_alive(pid) and _mps_program(pid))


def _pid_lines(answer: str) -> list[int]:
    """The pids in a control command's answer: lines of nothing but pids, never digits inside a message."""
    return [int(pid) for line in answer.splitlines() if re.fullmatch(r"[\d\s]+", line) for pid in line.split()]
