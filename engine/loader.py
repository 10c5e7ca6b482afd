"""Weights in one flat byte arena, so a second process can map the same memory and bind its own
Model to it.

The layout is a pure function of the parameter order (fixed by the config), so binding the same
arena in two processes yields the same weights without any message describing the layout.

A tensor-parallel rank's arena holds its shard only, and it reads only that from the checkpoint
(safetensors' slices: the rest of a tensor is never in its memory); rank_slice says which part of
each tensor is whose.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from engine.config import (
    ModelConfig,
    ModelError,
    check_model_folder,
    expert_names,
    missing_tensors_error,
    resolve_dtype,
    safetensors_index,
)
from engine.model import Model, kv_bounds
from engine.parallel import SINGLE, TensorParallel
from engine.quant import FP8, FP8_MAX, Fp8Linear, Fp8Scheme, QuantError, checkpoint_scale, quantize

ALIGN = 64  # bytes; covers every dtype's alignment and a cache line


def build_model(cfg: ModelConfig, dtype: torch.dtype) -> Model:
    """Model whose parameters are not yet backed by memory (meta device); bind_arena gives them
    storage."""
    with torch.device("meta"):
        return Model(cfg, dtype)


def _fused_groups(model: Model) -> list[tuple[nn.Module, str, list[str]]]:
    """(module, attribute, full parameter names) for every group of parameters the model reads as
    one tensor."""
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
    """(name, parameter, byte offset) for every parameter: registration order, 64-byte aligned,
    except that the members of a fused group (q/k/v, gate/up) follow each other with no gap, so
    one view spans them."""
    params = dict(model.named_parameters())
    follows: dict[str, list[str]] = {}  # first member of a group -> the rest, placed right after it
    for _, _, names in _fused_groups(model):
        # Adjacent members keep every parameter 64-byte aligned only if the leading ones are whole
        # multiples.
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
    """Make every parameter a view into arena (1-D uint8 tensor of arena_nbytes(model) bytes, on the
    model's target device), at deterministic offsets from the parameter order, so two processes
    binding the same arena see the same weights; then give each fused group its one view (or None
    where the layout could not make it adjacent)."""
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


def rank_slice(cfg: ModelConfig, rank: int, name: str) -> tuple[int, int, int, int] | None:
    """(dimension, start, end, the whole tensor's size there) of the checkpoint tensor `name` that
    tensor-parallel rank `rank` of a sharded config (ModelConfig.sharded) holds; None where every
    rank holds all of it."""
    if cfg.tp_size == 1:
        return None
    n, d = cfg.tp_size, cfg.head_dim
    leaf = name.rsplit(".", 2)
    kind = leaf[-2] if len(leaf) >= 2 else ""
    if kind == "q_proj":
        return 0, rank * cfg.num_heads * d, (rank + 1) * cfg.num_heads * d, n * cfg.num_heads * d
    if kind in ("k_proj", "v_proj"):
        first = rank // cfg.kv_head_replicas * cfg.num_kv_heads
        whole = n * cfg.num_kv_heads // cfg.kv_head_replicas
        return 0, first * d, (first + cfg.num_kv_heads) * d, whole * d
    if kind == "o_proj":
        return 1, rank * cfg.num_heads * d, (rank + 1) * cfg.num_heads * d, n * cfg.num_heads * d
    expert = ".experts." in name
    if kind in ("gate_proj", "up_proj", "down_proj") or expert and kind in ("w1", "w2", "w3"):
        w = cfg.moe_intermediate_size if expert else cfg.intermediate_size
        return (1 if kind in ("down_proj", "w2") else 0), rank * w, (rank + 1) * w, n * w
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = cfg.vocab_rows
        return (
            0,
            min(rank * rows, cfg.vocab_size),
            min((rank + 1) * rows, cfg.vocab_size),
            cfg.vocab_size,
        )
    return None


def checkpoint_targets(model: Model) -> dict[str, Tensor]:
    """Each checkpoint tensor the model reads and the bound parameter, or part of one, it fills:
    the parameter of the same name, but for a mixture of experts' per-expert projections, which
    fill their expert's rows of the stacked w13 (gate, then up) or its w2, and Mixtral's router."""
    cfg = model.cfg
    targets = dict(model.named_parameters())
    for name in [n for n in targets if n.endswith(".weight_scale")]:
        del targets[name]  # an FP8 layer's scales: filled with its weight (_load_fp8)
    width = cfg.moe_intermediate_size
    for layer in cfg.moe_layers:
        p = f"model.layers.{layer}.mlp."
        router, experts = expert_names(cfg, layer)
        targets[router] = targets.pop(p + "gate.weight")
        w13, w2 = targets.pop(p + "w13"), targets.pop(p + "w2")
        for e, (gate, up, down) in enumerate(experts):
            targets[gate], targets[up], targets[down] = w13[e, :width], w13[e, width:], w2[e]
    return targets


@torch.no_grad()
def load_weights(
    model: Model, folder: str | Path, load_format: str = "auto", seed: int = 0
) -> None:
    """Fill the bound parameters from the folder's *.safetensors (cast to the model dtype), or for
    load_format 'dummy' with deterministic random values (normal, std 0.02; norms all ones; each
    tensor-parallel rank's its own). A sharded model (model.cfg from ModelConfig.sharded) reads its
    rank's slices (rank_slice). Missing tensors -> ModelError."""
    params = dict(model.named_parameters())
    cfg, rank = model.cfg, model.tp.rank
    if load_format == "dummy":
        gen = torch.Generator(device=next(iter(params.values())).device).manual_seed(
            seed + 1000 * rank
        )
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dtype == FP8:  # drawn in float32, then quantized as --quantization fp8 does
                w = torch.empty(p.shape, device=p.device).normal_(0.0, 0.02, generator=gen)
                _store_fp8(model, name, *quantize(w, _fp8_module(model, name).group))
            elif not name.endswith(".weight_scale"):
                p.normal_(0.0, 0.02, generator=gen)
        return
    if load_format not in ("auto", "safetensors"):
        raise ModelError(
            f"unknown load format {load_format!r}; use one of: auto, safetensors, dummy"
        )
    index = safetensors_index(folder)
    targets = checkpoint_targets(model)
    missing = [name for name in targets if name not in index]
    if missing:
        raise missing_tensors_error(folder, missing)
    for file in sorted({index[name] for name in targets}):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in targets or index[name] != file:
                    continue
                part = rank_slice(cfg, rank, name)
                source = f.get_slice(name)
                expected = list(targets[name].shape)
                if part is not None:
                    expected[part[0]] = part[3]
                if tuple(source.get_shape()) != tuple(expected):
                    raise ModelError(
                        f"tensor {name} in {file} has shape {tuple(source.get_shape())}, expected "
                        f"{tuple(expected)} "
                        "(config.json does not match the weights)"
                    )
                if part is None:
                    tensor = f.get_tensor(name)
                else:
                    dim, start, end, _ = part
                    tensor = source[start:end] if dim == 0 else source[:, start:end]
                target = targets[name]
                if target.dtype == FP8:
                    _load_fp8(model, name, tensor, part, lambda key: _read(folder, index, key))
                    continue
                if tensor.shape[0] < target.shape[0]:  # the last rank's rows of a padded vocabulary
                    target[tensor.shape[0] :].zero_()
                    target = target[: tensor.shape[0]]
                target.copy_(tensor)


def _read(folder: str | Path, index: dict[str, Path], name: str) -> Tensor:
    """One whole tensor of the checkpoint, from whichever file holds it."""
    if name not in index:
        raise missing_tensors_error(folder, [name])
    with safe_open(index[name], framework="pt") as f:
        return f.get_tensor(name)


def _fp8_module(model: Model, name: str) -> Fp8Linear:
    module = model.get_submodule(name.removesuffix(".weight"))
    assert isinstance(module, Fp8Linear), f"{name} is not an FP8 layer's weight"
    return module


def _store_fp8(model: Model, name: str, data: Tensor, scale: Tensor) -> None:
    module = _fp8_module(model, name)
    module.weight.copy_(data)
    module.weight_scale.copy_(scale)


def _load_fp8(
    model: Model,
    name: str,
    tensor: Tensor,
    part: tuple[int, int, int, int] | None,
    read: Callable[[str], Tensor],
) -> None:
    """Fill the FP8 layer whose checkpoint weight is `name` (tensor: this rank's part of it): a
    higher-precision weight quantized per output row (--quantization fp8), an FP8 one copied with
    its scales (the checkpoint's, as one per row and group: engine/quant.py), each the rank's
    part."""
    module = _fp8_module(model, name)
    scheme = model.cfg.quantization
    assert isinstance(scheme, Fp8Scheme)
    if scheme.source == "online":
        if tensor.dtype == FP8:
            raise ModelError(
                f"{name} is stored in FP8 but config.json has no quantization_config saying how "
                "it is scaled (is the file complete?)"
            )
        _store_fp8(model, name, *quantize(tensor, module.group))
        return
    if tensor.dtype != FP8:
        raise ModelError(
            f"{name} is stored in {tensor.dtype}, not FP8 as config.json's quantization_config "
            "says (config.json does not match the weights)"
        )
    dim, start, end, whole = part if part is not None else (0, 0, tensor.shape[0], tensor.shape[0])
    rows = whole if dim == 0 else tensor.shape[0]
    columns = whole if dim == 1 else tensor.shape[1]
    try:
        scale = checkpoint_scale(scheme, name, read, rows, columns)
    except QuantError as e:
        raise ModelError(
            f"{e} (config.json's quantization_config does not match the weights)"
        ) from e
    if dim == 0:
        scale = scale[start:end]
    elif scale.shape[1] > 1:  # block scales: the rank's columns are whole blocks
        if start % module.group:
            raise ModelError(
                f"{name}: tensor parallelism splits its {columns} columns at {start}, inside a "
                f"{module.group}-column scale block; serve it with fewer ranks"
            )
        scale = scale[:, start // module.group : -(-end // module.group)]
    _store_fp8(model, name, tensor, scale)


def kv_scales(model: Model, folder: str | Path, load_format: str) -> list[tuple[float, float]]:
    """Each layer's (key, value) scales for an FP8 KV pool: the checkpoint's (vLLM's names,
    `self_attn.k_scale` and `self_attn.v_scale`) where it has them, else computed from the weights
    so that no key or value the layer can produce exceeds e4m3's range (model.kv_bounds: a bound,
    not a calibration, so the scales are larger than a calibration's)."""
    index = {} if load_format == "dummy" else safetensors_index(folder)
    scales = []
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}.self_attn."
        if p + "k_scale" in index and p + "v_scale" in index:
            pair = tuple(
                float(_read(folder, index, p + n).float().max()) for n in ("k_scale", "v_scale")
            )
        else:
            pair = tuple(max(bound, 1e-6) / FP8_MAX for bound in kv_bounds(layer))
        scales.append(pair)
    return scales


def load_model(
    folder: str | Path,
    dtype_name: str = "auto",
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    arena: Tensor | None = None,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
    fp8_activations: str = "dynamic",
) -> tuple[Model, ModelConfig]:
    """Convenience for single-process use and tests: config (quantized as asked, tp's shard of
    it), build, allocate the arena (or use the given one), bind, load."""
    cfg = check_model_folder(folder, load_format)
    cfg = cfg.quantized(quantization, fp8_activations).sharded(tp.size)
    model = build_model(cfg, resolve_dtype(dtype_name, cfg))
    model.tp = tp
    if arena is None:
        arena = torch.empty(arena_nbytes(model), dtype=torch.uint8, device=device)
    bind_arena(model, arena)
    load_weights(model, folder, load_format)
    return model, cfg
