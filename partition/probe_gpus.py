"""Which GPUs this host has, read without changing anything: NVML in the probe's process, torch in a
child.

NVML (nvidia-ml-py, `import pynvml`) gives what the driver knows (name, UUID, memory, driver and
CUDA driver versions, compute capability, MIG and compute mode); a child process gives what torch
sees under the CUDA_VISIBLE_DEVICES in effect (the SM count, and the device order the probe's other
steps use). The two are matched by UUID, since NVML numbers devices physically and torch after
CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
from typing import Any

from partition.child import Env, Finding, error_text, guarded, run_in_child
from partition.driver import mps_enabled, text

COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


def list_gpus(env: Env, timeout: float) -> tuple[list[dict[str, Any]], Finding, Finding]:
    """(one merged entry per torch-visible device, the NVML finding, the torch finding)."""
    nvml = guarded(nvml_inventory)
    seen = run_in_child(torch_inventory, env=env, timeout=timeout)
    by_uuid = {_norm_uuid(d.get("uuid")): d for d in nvml.get("devices", [])}
    gpus = []
    for device in seen.get("devices", []):
        facts = by_uuid.get(_norm_uuid(device.get("uuid")), {})
        gpus.append(
            {
                "index": device["index"],
                "nvml_index": facts.get("nvml_index"),
                "name": device.get("name"),
                "uuid": facts.get("uuid", device.get("uuid")),
                "sm_count": device.get("sm_count"),
                "compute_capability": device.get("compute_capability"),
                "memory_total_bytes": facts.get(
                    "memory_total_bytes", device.get("total_memory_bytes")
                ),
                "memory_used_bytes": facts.get("memory_used_bytes"),
                "l2_cache_bytes": device.get("l2_cache_bytes"),
                "driver_version": nvml.get("driver_version"),
                "cuda_driver_version": nvml.get("cuda_driver_version"),
                "mig_mode": facts.get("mig_mode"),
                "compute_mode": facts.get("compute_mode"),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }
        )
    return gpus, nvml, seen


def nvml_inventory() -> Finding:
    """NVML's view of every GPU on the host; ok=False (with the reason) where NVML is missing or
    fails."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return {"ok": False, "error": f"NVML unavailable: {error_text(exc)}", "devices": []}
    try:
        return {
            "ok": True,
            "error": None,
            "driver_version": _attempt(lambda: text(pynvml.nvmlSystemGetDriverVersion())),
            "cuda_driver_version": _attempt(
                lambda: _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion_v2())
            ),
            "devices": [_nvml_device(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())],
        }
    except Exception as exc:
        return {"ok": False, "error": error_text(exc), "devices": []}
    finally:
        pynvml.nvmlShutdown()


def _nvml_device(pynvml: Any, index: int) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = _attempt(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    return {
        "nvml_index": index,
        "name": _attempt(lambda: text(pynvml.nvmlDeviceGetName(handle))),
        "uuid": _attempt(lambda: text(pynvml.nvmlDeviceGetUUID(handle))),
        "memory_total_bytes": getattr(memory, "total", memory),
        "memory_used_bytes": getattr(memory, "used", memory),
        "compute_capability": _attempt(
            lambda: "%d.%d" % tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
        ),
        "mig_mode": _attempt(lambda: _mig_mode(pynvml.nvmlDeviceGetMigMode(handle))),
        "compute_mode": _attempt(lambda: _compute_mode(pynvml.nvmlDeviceGetComputeMode(handle))),
    }


def torch_inventory() -> Finding:
    """Runs in a child: the devices torch sees (this initialises CUDA, hence the child)."""
    import torch

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "uuid": str(props.uuid) if hasattr(props, "uuid") else None,
                "sm_count": props.multi_processor_count,
                "compute_capability": f"{props.major}.{props.minor}",
                "total_memory_bytes": props.total_memory,
                "l2_cache_bytes": getattr(props, "L2_cache_size", None),
            }
        )
    return {"devices": devices, "mps_enabled": mps_enabled(0) if devices else None}


def _attempt(read: Any) -> Any:
    """One NVML field: its value, or the error as text, so one unsupported query does not lose the
    others."""
    try:
        return read()
    except Exception as exc:
        return f"unavailable: {error_text(exc)}"


def _mig_mode(modes: Any) -> dict[str, int]:
    current, pending = modes
    return {"current": int(current), "pending": int(pending)}


def _compute_mode(mode: int) -> str:
    return COMPUTE_MODES.get(int(mode), str(mode))


def _cuda_version(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _norm_uuid(uuid: Any) -> str:
    return str(uuid).lower().removeprefix("gpu-")
