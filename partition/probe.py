"""`ppd probe`: what this host offers for splitting one GPU between a prefill and a decode worker,
measured.

Issue 9 chooses the partition design (two MPS processes, green contexts, both, or plain
time-slicing) from this report. `ppd probe [--out FILE.json] [--skip-mps] [--quick] [--device N]`
prints a table, writes the JSON (default: probe-<UTC time>.json in $PPD_RESULTS_DIR, else in
./ppd-results; named as it starts and again at its end) and exits 0 whenever the probe ran to its
end: a failed check is a finding, not an error (1 only if the JSON cannot be written). Without a
CUDA device it says "no CUDA device: nothing to probe", reports the host and its CPU, and writes the
JSON with "gpus": [] and the verdict "cpu"; on a host without an NVIDIA driver NVML and CUDA are
skipped, not failed. --quick: shorter kernels and a 64 MiB IPC tensor instead of 1 GiB (for tests).

Every GPU check runs in spawned processes with timeouts (partition/child.py), so none can crash or
hang the probe, and the probe's own process never initialises CUDA. The checks, in order: cpu the
CPU's extensions, the dtype and kernels ppd serve picks (in-process, no CUDA) probe_cpu.py gpus NVML
facts + torch's device properties probe_gpus.py ipc CUDA IPC round trip of one tensor via
engine/shared_memory probe_ipc.py overlap do two processes' kernels run at once (no MPS)
probe_overlap.py, probe_kernels.py green_contexts SM partitions inside one process (driver API)
probe_green.py mps our own MPS daemon and its clients; ipc, overlap and green_contexts again under
it probe_mps.py verdict which partition modes look usable, each with a reason probe_report.py

JSON schema 1: every field of the report, in docs/gpu.md ("The report's schema"). Times are in
seconds, sizes in bytes; every finding is a dict with "ok" and "error" (a check not run: ok false,
error null, "skipped": why).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from partition.child import Env, Finding, failed, guarded, run_in_child, skipped
from partition.driver import NO_DRIVER, nvidia_driver_present
from partition.probe_cpu import cpu_facts
from partition.probe_gpus import list_gpus, nvml_inventory
from partition.probe_green import green_context_check
from partition.probe_ipc import ipc_round_trip
from partition.probe_mps import probe_mps
from partition.probe_overlap import measure_overlap
from partition.probe_report import partition_verdict, render_table
from profiles import results_path

SCHEMA_VERSION = 1
SCHEMA_KEYS = (
    "schema",
    "host",
    "cpu",
    "gpus",
    "ipc",
    "overlap",
    "green_contexts",
    "mps",
    "verdict",
)
NO_CUDA = "no CUDA device: nothing to probe"
CHECKS = ("ipc", "overlap", "green_contexts", "mps")
STEP_TIMEOUT_S = 180.0


def add_probe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default=None,
        help="where to write the JSON report (default: probe-<UTC time>.json "
        "in $PPD_RESULTS_DIR, else in ./ppd-results)",
    )
    parser.add_argument(
        "--skip-mps",
        action="store_true",
        help="do not start an MPS daemon or probe anything under it",
    )
    parser.add_argument(
        "--quick", action="store_true", help="shorter kernels and a 64 MiB IPC tensor (for tests)"
    )
    parser.add_argument(
        "--device",
        type=int,
        default=0,
        help="the CUDA device (torch's index) to probe (default: 0)",
    )


def run_probe(args: argparse.Namespace) -> int:
    """Probe, write the JSON, print the table; 0 once the probe ran (findings may be failures), 1 if
    unwritable."""
    out = Path(args.out or results_path("probe", ".json"))
    print(f"ppd probe: the report goes to {out}", file=sys.stderr, flush=True)
    report = collect(device=args.device, quick=args.quick, skip_mps=args.skip_mps)
    if report["verdict"]["preferred"] == "cpu":
        print(NO_CUDA)
    print(render_table(report))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    except OSError as exc:
        print(f"ppd probe: error: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def collect(device: int = 0, quick: bool = False, skip_mps: bool = False) -> dict[str, Any]:
    """The whole report (see the module docstring); never raises for a failed check."""
    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "host": host_facts(),
        "cpu": guarded(cpu_facts),
        "gpus": [],
        **{check: skipped(NO_CUDA) for check in CHECKS},
    }
    workdir = Path(tempfile.mkdtemp(prefix="ppd-probe-"))
    try:
        _probe(report, workdir, device, quick, skip_mps)
    finally:
        # An MPS daemon that would not stop keeps its pipe and logs, for whoever cleans up after it.
        if report["mps"].get("stop", {}).get("stopped", True):
            shutil.rmtree(workdir, ignore_errors=True)
    report["verdict"] = partition_verdict(report)
    return report


def _probe(report: dict[str, Any], workdir: Path, device: int, quick: bool, skip_mps: bool) -> None:
    import torch

    if not nvidia_driver_present():
        report["host"].update(nvml=skipped(NO_DRIVER), torch_devices=skipped(NO_DRIVER))
        return
    if torch.version.cuda is None:
        report["host"]["nvml"] = guarded(nvml_inventory)  # NVML may see a GPU this torch cannot use
        report["host"]["torch_devices"] = skipped("this torch has no CUDA")
        return
    # Children outside the MPS part get an empty pipe directory: a daemon someone else runs cannot
    # adopt them.
    (workdir / "no-mps").mkdir()
    no_mps: Env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(workdir / "no-mps"),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None,
    }
    _progress("reading the GPUs")
    report["gpus"], report["host"]["nvml"], report["host"]["torch_devices"] = list_gpus(
        no_mps, STEP_TIMEOUT_S
    )
    if not report["gpus"]:
        return
    chosen = next((gpu for gpu in report["gpus"] if gpu["index"] == device), None)
    if chosen is None:
        missing = failed(f"--device {device}: torch sees {len(report['gpus'])} device(s)")
        report.update({check: missing for check in CHECKS})
        return
    report.update(_workloads(no_mps, device, chosen["nvml_index"], quick, "without MPS"))
    if skip_mps:
        report["mps"] = skipped("--skip-mps")
        return
    _progress("MPS: our own daemon")
    report["mps"] = guarded(
        probe_mps,
        device,
        chosen["nvml_index"],
        workdir,
        lambda env: _workloads(env, device, chosen["nvml_index"], quick, "under our MPS daemon"),
    )


def _workloads(env: Env, device: int, nvml_index: int | None, quick: bool, where: str) -> Finding:
    """The IPC, overlap and green-context checks, each in its own children with env."""
    ipc_bytes = (64 if quick else 1024) * 2**20
    _progress(f"CUDA IPC of {ipc_bytes >> 20} MiB between two processes, {where}")
    ipc = run_in_child(
        ipc_round_trip, (device, ipc_bytes, nvml_index, STEP_TIMEOUT_S), env, 2 * STEP_TIMEOUT_S
    )
    _progress(f"overlap of two processes' kernels, {where}")
    overlap = guarded(measure_overlap, device, 50.0 if quick else 200.0, env, STEP_TIMEOUT_S)
    _progress(f"green contexts, {where}")
    green = run_in_child(green_context_check, (device, quick), env, STEP_TIMEOUT_S)
    return {"ipc": ipc, "overlap": overlap, "green_contexts": green}


def host_facts() -> dict[str, Any]:
    """What can be read without a GPU: the machine, the Python stack's versions,
    CUDA_VISIBLE_DEVICES."""
    import torch

    return {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "is_root": os.geteuid() == 0,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "cuda_bindings": _version("cuda-bindings"),
        "nvidia_ml_py": _version("nvidia-ml-py"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _progress(step: str) -> None:
    print(f"ppd probe: {step} ...", file=sys.stderr, flush=True)
