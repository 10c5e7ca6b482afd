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


def _fused_groups(model: Model) -> list[tuple[nn.Module, str, list[str]]]:
    """(module, attribute, full parameter names) for every group of parameters the model reads as one tensor."""
    groups = []
    for module_name, module in model.named_modules():
        if hasattr(module, "fused_groups"):
            for attr, names in module.fused_groups().items():
                groups.append((module, attr, [f"{module_name}.{n}" for n in names]))
    return groups


def _nbytes(p: Tensor) -> int:
    return p.numel() * p.element_size()


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _layout(model: Model) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, byte offset) for every parameter: registration order, 64-byte aligned, except that the
    members of a fused group (q/k/v, gate/up) follow each other with no gap, so one view spans them."""
    params = dict(model.named_parameters())
    follows: dict[str, list[str]] = {}  # first member of a group -> the rest, placed right after it
    for _, _, names in _fused_groups(model):
        # Adjacent members keep every parameter 64-byte aligned only if the leading ones are whole multiples.
        if all(_nbytes(params[n]) % ALIGN == 0 for n in names[:-1]):
            follows[names[0]] = names[1:]
    placed: set[str] = set()
    out, offset = [], 0
    for name in params:
        if name in placed:
            continue
        for member in [name, *follows.get(name, [])]:
            out.append((member, params[member], offset))
            placed.add(member)
            offset += _nbytes(params[member])
        offset = _padded(offset)
    return out


def arena_nbytes(model: Model) -> int:
    """Size in bytes of the arena that holds all of model's parameters."""
    _, p, offset = _layout(model)[-1]
    return _padded(offset + _nbytes(p))


def bind_arena(model: Model, arena: Tensor) -> None:
    """Make every parameter a view into arena (1-D uint8 tensor of arena_nbytes(model) bytes, on the model's target
    device), at deterministic offsets from the parameter order, so two processes binding the same arena see the
    same weights; then give each fused group its one view (or None where the layout could not make it adjacent)."""
    assert arena.dtype == torch.uint8 and arena.dim() == 1, "arena must be a 1-D uint8 tensor"
    assert arena.numel() >= arena_nbytes(model), "arena smaller than arena_nbytes(model)"
    assert arena.data_ptr() % ALIGN == 0, "arena must start 64-byte aligned"
    layout = _layout(model)
    for name, p, offset in layout:
        view = arena[offset : offset + _nbytes(p)].view(p.dtype).view(p.shape)
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(view, requires_grad=False))
    offsets = {name: offset for name, _, offset in layout}
    params = dict(model.named_parameters())
    for module, attr, names in _fused_groups(model):
        first, last = names[0], names[-1]
        end = offsets[last] + _nbytes(params[last])
        if end - offsets[first] != sum(_nbytes(params[n]) for n in names):
            setattr(module, attr, None)
            continue
        p0 = params[first]
        rows = sum(params[n].shape[0] for n in names)
        setattr(module, attr, arena[offsets[first] : end].view(p0.dtype).view(rows, *p0.shape[1:]))
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
