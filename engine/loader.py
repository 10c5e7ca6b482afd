"""Weights in one flat byte arena, so a second process can map the same memory and bind its own Model to it.

The layout is a pure function of the parameter order (fixed by the config), so binding the same arena in two
processes yields the same weights without any message describing the layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from engine.config import (
    ModelConfig,
    ModelError,
    check_model_folder,
    missing_tensors_error,
    resolve_dtype,
    safetensors_index,
)
from engine.model import Model

ALIGN = 64  # bytes; covers every dtype's alignment and a cache line


def build_model(cfg: ModelConfig, dtype: torch.dtype) -> Model:
    """Model whose parameters are not yet backed by memory (meta device); bind_arena gives them storage."""
    with torch.device("meta"):
        return Model(cfg, dtype)


def _layout(model: Model) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, byte offset) for every parameter, in registration order."""
    out, offset = [], 0
    for name, p in model.named_parameters():
        out.append((name, p, offset))
        offset += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    return out


def arena_nbytes(model: Model) -> int:
    """Size in bytes of the arena that holds all of model's parameters."""
    return sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in model.parameters())


def bind_arena(model: Model, arena: Tensor) -> None:
    """Make every parameter a view into arena (1-D uint8 tensor of arena_nbytes(model) bytes, on the model's target device),
    at deterministic, 64-byte aligned offsets from the parameter order, so two processes binding the same arena see the same weights."""
    assert arena.dtype == torch.uint8 and arena.dim() == 1, "arena must be a 1-D uint8 tensor"
    assert arena.numel() >= arena_nbytes(model), "arena smaller than arena_nbytes(model)"
    assert arena.data_ptr() % ALIGN == 0, "arena must start 64-byte aligned"
    for name, p, offset in _layout(model):
        view = arena[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(view, requires_grad=False))
    model.init_rope(arena.device)


@torch.no_grad()
def load_weights(model: Model, folder: str | Path, load_format: str = "auto", seed: int = 0) -> None:
    """Fill the bound parameters from the folder's *.safetensors (cast to the model dtype), or for load_format
    'dummy' with deterministic random values (normal, std 0.02; norms all ones). Missing tensors -> ModelError."""
    params = dict(model.named_parameters())
    if load_format == "dummy":
        gen = torch.Generator(device=next(iter(params.values())).device).manual_seed(seed)
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        return
    if load_format not in ("auto", "safetensors"):
        raise ModelError(f"unknown load format {load_format!r}; use one of: auto, safetensors, dummy")
    index = safetensors_index(folder)
    missing = [name for name in params if name not in index]
    if missing:
        raise missing_tensors_error(folder, missing)
    for file in sorted({index[name] for name in params}):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in params or index[name] != file:
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ModelError(
                        f"tensor {name} in {file} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(params[name].shape)} (config.json does not match the weights)"
                    )
                params[name].copy_(tensor)


def load_model(
    folder: str | Path,
    dtype_name: str = "auto",
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    arena: Tensor | None = None,
) -> tuple[Model, ModelConfig]:
    """Convenience for single-process use and tests: config, build, allocate the arena (or use the given one), bind, load."""
    cfg = check_model_folder(folder, load_format)
    model = build_model(cfg, resolve_dtype(dtype_name, cfg))
    if arena is None:
        arena = torch.empty(arena_nbytes(model), dtype=torch.uint8, device=device)
    bind_arena(model, arena)
    load_weights(model, folder, load_format)
    return model, cfg
