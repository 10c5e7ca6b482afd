"""MPS on this host: is nvidia-cuda-mps-control there, does a daemon already run, can we run our
own, and do clients of ours really run under it (the daemon's machinery: mps.py).

Our daemon gets a private pipe and log directory under the probe's temp dir. Nothing here changes
the GPU (compute mode, clocks, MIG). probe_mps always stops the daemon it started and reports
whether it really stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

from partition.child import Env, Finding, error_text, guarded, skipped
from partition.mps import (
    COMMAND_TIMEOUT_S,
    CONTROL,
    DEFAULT_PIPE_DIR,
    PID_FILE,
    Daemon,
    check_client,
    mps_program,
    read_pid,
    start_daemon,
    stop_daemon,
)


def probe_mps(
    device: int, nvml_index: int | None, workdir: Path, under_mps: Callable[[Env], Finding]
) -> Finding:
    """The MPS findings; under_mps(env) runs the IPC, overlap and green-context probes as clients of
    our daemon."""
    binary = shutil.which(CONTROL)
    found: Finding = {
        "ok": False,
        "error": None,
        "control_binary": binary,
        "existing": existing_daemon(),
    }
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
        found["thread_percentage_50"] = guarded(
            check_client, daemon, device, nvml_index, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
        )
        if found["client"].get("is_mps_client"):
            found["under_mps"] = guarded(
                under_mps, {**daemon.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None}
            )
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
    return {
        "pipe_directory": str(pipe_dir),
        "pipe_directory_exists": pipe_dir.is_dir(),
        "control_pid_file": read_pid(pipe_dir / PID_FILE),
        "processes": processes,
        "running": bool(processes),
    }


def mps_processes() -> list[dict[str, Any]]:
    """Every nvidia-cuda-mps-* process on the host, from /proc."""
    pids = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return [{"pid": pid, "command": name} for pid in pids if (name := mps_program(pid))]


def static_partitioning(daemon: Daemon) -> Finding:
    """Whether the control binary's usage mentions static SM partitions (-S /
    --static-partitioning); only read. Run with our (not yet started) pipe directory, so a stray
    client call can reach no other daemon."""
    texts = {}
    for flag in ("-h", "--help", "-v"):
        try:
            done = subprocess.run(
                [daemon.binary, flag],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env={**os.environ, **daemon.env},
                timeout=COMMAND_TIMEOUT_S,
            )
            texts[flag] = (done.stdout + done.stderr).strip()[:2000]
        except Exception as exc:
            texts[flag] = error_text(exc)
    usage = f"{texts['-h']}\n{texts['--help']}"
    offered = "--static-partitioning" in usage or re.search(r"(^|\s)-S\b", usage) is not None
    return {
        "offered": offered,
        "usage": usage,
        "version": texts["-v"],
        "env_CUDA_MPS_SM_PARTITION": os.environ.get("CUDA_MPS_SM_PARTITION"),
    }
