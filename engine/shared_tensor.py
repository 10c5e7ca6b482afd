"""Tensors that a second process maps without a copy.

On the CPU a shared tensor is a file in /dev/shm mapped MAP_SHARED by each
process (torch.from_file), the stand-in for a CUDA IPC handle: the decode
worker creates the weight arena and the KV pool this way, the prefill worker
opens the same files, and both see one copy of the memory.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import msgspec
import torch

SHM_DIR = Path("/dev/shm")


class SharedTensorHandle(msgspec.Struct, frozen=True):
    """Everything another process needs to map a shared tensor."""

    path: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32", a torch dtype attribute name


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), f"not a torch dtype: {name}"
    return dtype


def create_shared(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, SharedTensorHandle]:
    """A new zero-filled shared tensor backed by /dev/shm/<name> (an existing file of that name is replaced)."""
    path = SHM_DIR / name
    path.unlink(missing_ok=True)
    numel = math.prod(shape)
    tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
    handle = SharedTensorHandle(path=str(path), shape=tuple(shape), dtype=str(dtype).removeprefix("torch."))
    return tensor, handle


def open_shared(handle: SharedTensorHandle) -> torch.Tensor:
    """Map the tensor another process created; writes are seen by both."""
    if not os.path.exists(handle.path):
        raise FileNotFoundError(f"shared tensor {handle.path} is gone (its owner exited or unlinked it)")
    numel = math.prod(handle.shape)
    return torch.from_file(handle.path, shared=True, size=numel, dtype=_torch_dtype(handle.dtype)).view(handle.shape)


def unlink_shared(handle: SharedTensorHandle) -> None:
    """Remove the name; the memory lives on while any process still maps it."""
    Path(handle.path).unlink(missing_ok=True)
