"""FP8 (e4m3) linear weights: how a model holds them, how a checkpoint stores them, and the linear
layer over them in plain PyTorch (the CPU path, and the reference the GPU's kernels match).

A quantized linear layer keeps its weight as float8_e4m3fn [N, K] and a float32 scale per output
row and group of `group` input columns, [N, ceil(K / group)]: the weight it stands for is
data * scale, each scale repeated over its group's columns. One layout covers every source:

- `--quantization fp8` on a bfloat16/float16/float32 checkpoint: quantized at load, one scale per
  output row (group = K), the row's absolute maximum over 448, e4m3's largest finite value;
- a checkpoint in FP8 (`quantization_config.quant_method` "fp8", as vLLM and transformers write
  it): a scale per tensor (`weight_scale`, repeated over the rows), or block scales
  (`weight_scale_inv` [ceil(N / bn), ceil(K / bk)] over bn x bk blocks, repeated over each block's
  rows: group = bk);
- compressed-tensors' FP8 (`quant_method` "compressed-tensors", a float 8-bit weight per tensor or
  per channel, `weight_scale` [N, 1] or [1]).

Activations are either quantized too, per token and group at each call (W8A8, `dynamic`: the
token's absolute maximum over 448, as the weight's), or left in the model's dtype (W8A16, `none`:
the weight is dequantized to it). Embeddings, norms, the router of a mixture of experts and the LM
head stay in the model's dtype, as every FP8 checkpoint keeps them.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# The smallest scale a group takes: an all-zero group's scale stays finite and its data zero.
MIN_SCALE = 1e-12

QUANTIZATIONS = ("fp8",)  # what --quantization takes
ACTIVATIONS = ("dynamic", "none")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # what --kv-cache-dtype takes


class QuantError(ValueError):
    """A quantization the server cannot serve, or a checkpoint's that it cannot read."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers hold FP8 weights, and where they come from.

    source: "online" (quantized at load from a higher-precision checkpoint), "fp8" (the
    checkpoint's, quant_method fp8) or "compressed-tensors"; block: the checkpoint's (rows,
    columns) scale blocks,
    None for a scale per tensor or per row; activations: "dynamic" (W8A8) or "none" (W8A16);
    ignored: modules (by the checkpoint's names, without `.weight`) the checkpoint keeps
    unquantized."""

    source: str
    block: tuple[int, int] | None = None
    activations: str = "dynamic"
    ignored: tuple[str, ...] = ()

    def group(self, in_features: int) -> int:
        """Input columns per scale of a layer of in_features columns."""
        return self.block[1] if self.block is not None else in_features

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer called module (e.g. 'model.layers.0.self_attn.q_proj') is held
        in FP8."""
        return not any(_names(module, name) for name in self.ignored)

    def describe(self) -> str:
        """One phrase for the start-up log: the source, the scales and the activations."""
        scales = (
            f"{self.block[0]}x{self.block[1]} block scales"
            if self.block
            else "a scale per output row"
        )
        source = {
            "online": "quantized at load",
            "fp8": "the checkpoint's",
            "compressed-tensors": "the checkpoint's (compressed-tensors)",
        }[self.source]
        acts = (
            "activations quantized per token (W8A8)"
            if self.activations == "dynamic"
            else "activations in the model's dtype (W8A16)"
        )
        return f"FP8 weights, {source}, {scales}, {acts}"


def _names(module: str, name: str) -> bool:
    """Whether a checkpoint's ignored-layer entry names module: the module's name or its tail, or
    a regular expression (compressed-tensors' `re:` entries) matching the whole name."""
    if name.startswith("re:"):
        return re.fullmatch(name[3:], module) is not None
    return module == name or module.endswith("." + name)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's FP8 weight as ops.linear takes it: data [N, K] e4m3, scale [N, G] float32,
    group columns per scale (the last group may be shorter), activations as in Fp8Scheme."""

    data: Tensor
    scale: Tensor
    group: int
    activations: str = "dynamic"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


class Fp8Linear(nn.Module):
    """A bias-optional linear layer whose weight is FP8 with its scales (Fp8Scheme's layout); its
    parameters are `weight` [N, K] e4m3, `weight_scale` [N, G] float32 and `bias` [N] in the
    model's dtype."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, scheme: Fp8Scheme
    ) -> None:
        super().__init__()
        self.group, self.activations = scheme.group(in_features), scheme.activations
        groups = -(-in_features // self.group)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None

    def fp8(self, data: Tensor | None = None, scale: Tensor | None = None) -> Fp8Weight:
        """The weight as ops.linear takes it (data and scale: a fused view spanning this layer's and
        its neighbours')."""
        return Fp8Weight(
            self.weight if data is None else data,
            self.weight_scale if scale is None else scale,
            self.group,
            self.activations,
        )


def make_linear(
    name: str,
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    scheme: Fp8Scheme | None,
) -> nn.Module:
    """The model's linear layer called name: an Fp8Linear where scheme quantizes it, else
    nn.Linear."""
    if scheme is not None and scheme.quantizes(name):
        return Fp8Linear(in_features, out_features, bias, dtype, scheme)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def weight_of(linear: nn.Module) -> Tensor | Fp8Weight:
    """What ops.linear takes for a layer made by make_linear."""
    return linear.fp8() if isinstance(linear, Fp8Linear) else linear.weight


# ---- quantizing and dequantizing ---------------------------------------------------------------


def _grouped(x: Tensor, group: int) -> Tensor:
    """x [..., K] as [..., G, group], zero-padded to whole groups."""
    k = x.shape[-1]
    pad = -k % group
    if pad:
        x = F.pad(x, (0, pad))
    return x.unflatten(-1, (x.shape[-1] // group, group))


def quantize(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (e4m3 data [..., K], float32 scales [..., ceil(K / group)]): each group of
    `group` columns scaled by its absolute maximum over FP8_MAX (at least MIN_SCALE), rounded to
    nearest e4m3 (float32 division, then one rounding)."""
    g = _grouped(x.float(), group)
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    data = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return data.flatten(-2)[..., : x.shape[-1]], scale


def expand_scale(scale: Tensor, group: int, k: int) -> Tensor:
    """Scales [..., G] repeated over their groups' columns: [..., k] float32."""
    return scale.float().repeat_interleave(group, dim=-1)[..., :k]


def dequantize(
    data: Tensor, scale: Tensor, group: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """data [..., K] e4m3 with scales [..., G] -> data x scale in float32 (each product rounded
    once: exact where float32 holds it), then dtype."""
    return (data.float() * expand_scale(scale, group, data.shape[-1])).to(dtype)


def rows_from_blocks(scale_inv: Tensor, block_rows: int, rows: int) -> Tensor:
    """A checkpoint's block scales [ceil(N / bn), G] as a scale per row and group: [N, G]."""
    return scale_inv.float().repeat_interleave(block_rows, dim=0)[:rows].contiguous()


# ---- the linear layer ----------------------------------------------------------------------------


# Weights' float32 copies kept by dense_copies (None: none kept, every call converts).
_DENSE: dict[int, tuple[weakref.ref, Tensor | None, torch.dtype, Tensor]] | None = None


@contextmanager
def dense_copies() -> Iterator[None]:
    """Within it, fp8_linear converts each FP8 weight to float once and keeps the copy (keyed by
    the weight's tensor), instead of at every call: the CPU's conversion of e4m3 runs at about
    10^8 values a second, a second a step of a 100M-parameter model. The arithmetic is the same but
    for the order of float32 sums; the memory is that of the unquantized model again. For
    benchmarks of FP8's accuracy on the CPU (bench/fp8_agreement.py), never the server."""
    global _DENSE
    _DENSE = {}
    try:
        yield
    finally:
        _DENSE = None


def _dense(data: Tensor, scale: Tensor | None, group: int, dtype: torch.dtype) -> Tensor:
    """data's e4m3 values (times scale, if given) in dtype: from dense_copies' cache where one is
    kept."""
    if _DENSE is None:
        return data.float().to(dtype) if scale is None else dequantize(data, scale, group, dtype)
    kept = _DENSE.get(id(data))
    if kept is None or kept[0]() is not data or kept[1] is not scale or kept[2] != dtype:
        made = data.float().to(dtype) if scale is None else dequantize(data, scale, group, dtype)
        kept = _DENSE[id(data)] = (weakref.ref(data), scale, dtype, made)
    return kept[3]


def fp8_linear(x: Tensor, w: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype. W8A16: x times the weight dequantized to x's
    dtype. W8A8: x quantized per token and group like the weight, each group's dot of e4m3 values
    accumulated in float32 and scaled by both scales (torch._scaled_mm's row-wise scaling where
    there is one group, the per-group sum otherwise), then rounded once to x's dtype."""
    if w.activations == "none":
        return F.linear(x, _dense(w.data, w.scale, w.group, x.dtype), bias)
    xq, xs = quantize(x, w.group)
    k = x.shape[-1]
    if w.scale.shape[-1] == 1 and _DENSE is not None:  # the same sums, over a kept float32 copy
        values = _dense(w.data, None, w.group, torch.float32)
        out = (xq.float() @ values.t()) * xs * w.scale.float().t()
    elif w.scale.shape[-1] == 1:
        out = torch._scaled_mm(
            xq,
            w.data.t(),
            scale_a=xs,
            scale_b=w.scale.float().t(),
            out_dtype=torch.float32,
        )
    else:
        out = x.new_zeros(x.shape[0], w.data.shape[0], dtype=torch.float32)
        values = _dense(w.data, None, w.group, torch.float32)
        for g in range(w.scale.shape[-1]):
            cols = slice(g * w.group, min(k, (g + 1) * w.group))
            part = xq[:, cols].float() @ values[:, cols].t()
            out += part * xs[:, g : g + 1] * w.scale[None, :, g].float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


# ---- checkpoints -------------------------------------------------------------------------------


def scheme_from_config(raw: dict[str, Any], folder: Any) -> Fp8Scheme | None:
    """The FP8 scheme a config.json's quantization_config describes; None without one; QuantError
    naming what is served for any other."""
    q = raw.get("quantization_config") or raw.get("compression_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantError(f"model folder {folder}: FP8 format {fmt!r}; ppd serves e4m3 weights")
        block = q.get("weight_block_size")
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
        return Fp8Scheme(
            "fp8",
            tuple(block) if block else None,
            "dynamic",
            tuple(ignored),
        )
    if method == "compressed-tensors":
        return _compressed_tensors(q, folder)
    raise QuantError(
        f"model folder {folder} is quantized with {method!r}; ppd serves FP8 checkpoints "
        "(quant_method fp8, or compressed-tensors' float 8-bit weights) and quantizes bfloat16, "
        "float16 or float32 ones to FP8 with --quantization fp8"
    )


def _compressed_tensors(q: dict[str, Any], folder: Any) -> Fp8Scheme:
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantError(
            f"model folder {folder}: compressed-tensors with {len(groups)} config groups; ppd "
            "reads one group of FP8 weights"
        )
    weights = groups[0].get("weights") or {}
    strategy = weights.get("strategy")
    if (
        weights.get("num_bits") != 8
        or weights.get("type") != "float"
        or strategy not in ("tensor", "channel", "block")
    ):
        raise QuantError(
            f"model folder {folder}: compressed-tensors weights {weights}; ppd reads float 8-bit "
            "weights with a scale per tensor, per channel or per block"
        )
    block = weights.get("block_structure") if strategy == "block" else None
    return Fp8Scheme(
        "compressed-tensors",
        tuple(block) if block else None,
        "dynamic",
        tuple(q.get("ignore") or ()),
    )


def checkpoint_scale(
    scheme: Fp8Scheme, name: str, read: Any, rows: int, in_features: int
) -> Tensor:
    """The scale [rows, G] of the checkpoint's FP8 weight `name` (`....weight`), read through read(
    tensor name) -> Tensor: per tensor repeated over the rows, per channel as it is, block scales
    repeated over their blocks' rows."""
    base = name.removesuffix(".weight")
    if scheme.block is not None:
        key = base + (".weight_scale_inv" if scheme.source == "fp8" else ".weight_scale")
        blocks = read(key)
        want = (-(-rows // scheme.block[0]), -(-in_features // scheme.block[1]))
        if tuple(blocks.shape) != want:
            raise QuantError(f"{key} has shape {tuple(blocks.shape)}, expected {want}")
        return rows_from_blocks(blocks, scheme.block[0], rows)
    scale = read(base + ".weight_scale").float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if scale.numel() == rows:
        return scale.reshape(rows, 1)
    raise QuantError(
        f"{base}.weight_scale has {scale.numel()} values; expected 1 (per tensor) or {rows} "
        "(per output channel)"
    )


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for --kv-cache-dtype name: 'auto' the model's, 'fp8' / 'fp8_e4m3' e4m3
    (with per-layer scales); QuantError naming what is served for anything else."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8
    raise QuantError(
        f"--kv-cache-dtype {name}: ppd stores the KV cache in the model's dtype (auto) or in FP8 "
        f"e4m3 (fp8, fp8_e4m3){'; e5m2 is not served' if name == 'fp8_e5m2' else ''}"
    )
