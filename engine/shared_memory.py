"""Tensors that a second process maps without a copy: one handle type per kind of memory.

The decode worker creates the weight arena and the KV pool with create_shared and
sends their handles to the prefill worker, which maps the same memory with
open_shared. The handle is opaque to everything between the two calls.

- CPU: a file in /dev/shm mapped MAP_SHARED by each process (torch.from_file).
  Its name can be released once both processes have mapped it.
- CUDA: a CUDA IPC handle of the tensor's cudaMalloc segment (torch's own
  sharing, which sends the segment's handle plus the offset). The tensor must
  be one allocation of its own, made while expandable segments are off (their
  sharing path has known bugs in containers), and the creating process must
  keep it alive for as long as any other process uses it: a unit's two
  workers live and die together.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import msgspec
import torch

SHM_DIR = Path("/dev/shm")


class ShmHandle(msgspec.Struct, frozen=True, tag="shm"):
    """A tensor in a /dev/shm file."""

    path: str
    shape: tuple[int, ...]
    dtype: str  # a torch dtype attribute name, e.g. "float32"


class CudaIpcHandle(msgspec.Struct, frozen=True, tag="cuda"):
    """A CUDA tensor's IPC handle: its segment's cudaIpcMemHandle plus where the tensor sits in it
    (torch's fields)."""

    shape: tuple[int, ...]
    dtype: str
    # the device index in the creating process (both workers of a unit see the same single GPU)
    device: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


SharedHandle = ShmHandle | CudaIpcHandle


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), f"not a torch dtype: {name}"
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def create_shared(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, SharedHandle]:
    """A new zero-filled tensor another process can map, and its handle.

    On the CPU it is backed by /dev/shm/<name> (an existing file of that name is replaced); on CUDA
    name is unused.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _create_cuda(shape, dtype, device)
    path = SHM_DIR / name
    path.unlink(missing_ok=True)
    tensor = torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    return tensor, ShmHandle(path=str(path), shape=tuple(shape), dtype=dtype_name(dtype))


def open_shared(handle: SharedHandle) -> torch.Tensor:
    """Map the tensor another process created; writes are seen by both. Nothing is copied."""
    if isinstance(handle, CudaIpcHandle):
        return _open_cuda(handle)
    if not os.path.exists(handle.path):
        raise FileNotFoundError(
            f"shared tensor {handle.path} is gone (its owner exited or unlinked it)"
        )
    numel = math.prod(handle.shape)
    return torch.from_file(
        handle.path, shared=True, size=numel, dtype=torch_dtype(handle.dtype)
    ).view(handle.shape)


def release_name(handle: SharedHandle) -> None:
    """Once every process has mapped the memory, drop its name, so it lives exactly as long as its
    users. (A CUDA IPC handle has no name: the memory lives as long as the creating process.)"""
    if isinstance(handle, ShmHandle):
        Path(handle.path).unlink(missing_ok=True)


def remove_leftover(name: str) -> None:
    """Remove what create_shared(name, ...) may have left on the host after its processes were
    killed."""
    (SHM_DIR / name).unlink(missing_ok=True)


def _create_cuda(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, CudaIpcHandle]:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    assert "expandable_segments:True" not in conf, (
        "CUDA IPC export needs expandable segments off in this process"
    )
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    storage = tensor.untyped_storage()
    (dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    return tensor, CudaIpcHandle(
        shape=tuple(shape),
        dtype=dtype_name(dtype),
        device=int(dev),
        storage_handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle) if event_handle is not None else None,
        event_sync_required=bool(event_sync),
    )


def _open_cuda(h: CudaIpcHandle) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = torch_dtype(h.dtype)
    stride = torch.empty(h.shape, device="meta").stride()
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(h.shape),
        stride,
        0,
        torch.UntypedStorage,
        dtype,
        h.device,
        h.storage_handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        False,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
