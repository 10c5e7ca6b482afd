"""Attention backends: an interface (base.py) and a registry; a new backend is a new file and one
line here.

`torch` (plain PyTorch, runs anywhere) is the reference; `cpu` (our C decode
kernel beside PyTorch's SDPA) is the CPU default; `triton` (our Triton kernels)
is the CUDA default.
"""

from __future__ import annotations

import importlib
import os

import torch

from engine.attention.base import AttentionBackend, AttentionShape, StepBatch

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionShape",
    "StepBatch",
    "create_backend",
    "default_backend",
]

# name -> module:class, imported on use so the CPU path never imports Triton.
BACKENDS = {
    "torch": "engine.attention.torch_backend:TorchBackend",
    "cpu": "engine.attention.cpu_backend:CpuBackend",
    "triton": "engine.attention.triton_backend:TritonBackend",
}


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "cpu"


def create_backend(name: str, shape: AttentionShape, device: torch.device) -> AttentionBackend:
    """The backend called name ('auto': the device's default) for this model shape on device."""
    if name == "auto":
        name = default_backend(device)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton attention backend needs a CUDA device (on the CPU it runs only in Triton's "
            "interpreter, TRITON_INTERPRET=1, which the tests use); use the torch backend on the "
            "CPU"
        )
    if name == "cpu" and device.type != "cpu":
        raise ValueError(
            f"the cpu attention backend runs on the CPU, not on {device.type}; use auto or triton "
            "there"
        )
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(shape, device)
