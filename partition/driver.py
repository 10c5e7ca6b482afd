"""What the running server asks the NVIDIA driver (cuda-bindings' driver API, and NVML), imported
only when called: the partitions' runtime (MPS, green contexts) and `ppd probe` both use these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partition.child import error_text

# What an NVIDIA driver leaves on a host: its kernel module's file, its control device, or (under
# WSL) the GPU device the Windows driver exposes. None of them: NVML and CUDA have nothing to find.
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg")
NO_DRIVER = "no NVIDIA driver on this host"


def nvidia_driver_present() -> bool:
    """Whether this host has an NVIDIA driver for NVML and CUDA to ask (NVIDIA_DRIVER_FILES)."""
    return any(Path(path).exists() for path in NVIDIA_DRIVER_FILES)


def cuda_driver() -> Any:
    """cuda-bindings' driver API module (cuda-python before 12.6 called it cuda.cuda)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver
    return driver


def driver_call(drv: Any, name: str, *args: Any) -> Any:
    """drv.<name>(*args) with its CUresult checked: the returned values (one, a tuple, or None), or
    RuntimeError."""
    result = getattr(drv, name)(*args)
    status, values = result[0], result[1:]
    if status != drv.CUresult.CUDA_SUCCESS:
        _, text = drv.cuGetErrorName(status)
        raise RuntimeError(f"{name} failed: {text(text)} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def mps_enabled(device: int) -> bool | None:
    """Whether this process's contexts on device go through MPS (CU_DEVICE_ATTRIBUTE_MPS_ENABLED);
    None if the driver or cuda-bindings cannot say. A client that cannot reach a daemon silently
    runs without MPS: this tells."""
    try:
        drv = cuda_driver()
        driver_call(drv, "cuInit", 0)
        dev = driver_call(drv, "cuDeviceGet", device)
        attribute = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MPS_ENABLED
        return bool(driver_call(drv, "cuDeviceGetAttribute", attribute, dev))
    except Exception:
        return None


def nvml_processes(nvml_index: int | None, mps: bool = False) -> list[dict[str, Any]] | str:
    """[{pid, used_bytes}] of the compute processes on a GPU (MPS clients if mps), or why NVML could
    not say. Under MPS, NVML charges clients' memory to the MPS server."""
    if nvml_index is None:
        return "unknown NVML index"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            if mps:
                processes = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
            else:
                processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            return [{"pid": int(p.pid), "used_bytes": p.usedGpuMemory} for p in processes]
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        return f"NVML: {error_text(exc)}"


def text(value: Any) -> str:
    """A driver or NVML string (bytes in older bindings) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)
