"""The CPU backend's ops: the linear layers on weights prepacked for oneDNN (bfloat16 ones of a
decode step's rows on AMX's tiles in cpu_amx.c where the CPU has AMX-BF16, else of a few rows in
cpu_gemv.c), RMSNorm, SiLU-and-multiply and RoPE fused.

oneDNN reorders a weight once into the blocked layout its GEMM kernels read, which runs a linear
faster than torch's linear on the plain weight (docs/cpu-engine.md#measurements-behind-the-code).
The packed copy is this process's own memory: a worker's weights take about twice their size (the
shared arena and the packed copy), and every runner of a process shares one packed copy per weight.
Where oneDNN is unavailable, or the dtype is not float32 or bfloat16, the plain weight is used.

On a CPU without native bfloat16 (engine/cpu_isa.py) PyTorch's bfloat16 GEMMs run at a fraction of
float32's speed, so a bfloat16 weight is prepacked as float32 (its copy twice the arena's bytes,
where a float32 model's is the same as its arena's) and multiplied in float32, x widened and the
output rounded to bfloat16 once, as torch rounds it; up to FEW_ROWS_WIDENED rows cpu_gemv.c reads
the bfloat16 weight itself and widens it in registers (half the bytes of the float32 copy).
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.attention.cpu_kernel import DTYPES, load
from engine.cpu_isa import cpu_flags, has_native_bf16
from engine.ops import TorchOps

# (kind, id(weight)) -> (a weak reference to the weight, its packed copy of that kind: "onednn" or
# "amx"). Weak, so that a weight freed (an engine closed) frees its copies, and an id reused by a
# later tensor is told apart by the reference.
_packed: dict[tuple[str, int], tuple[weakref.ref, Tensor | None]] = {}
_lock = threading.Lock()

# The row limits below come from timing each kernel against oneDNN (the figures and their sources:
# docs/cpu-engine.md#measurements-behind-the-code).
# bfloat16 linears of up to this many rows run in cpu_gemv.c (on CPUs with AVX512-BF16), the rest in
# oneDNN, whose blocked weights compute faster than the kernel streams from 3 rows on.
FEW_ROWS = 2
# Without native bfloat16 the kernel, reading the bfloat16 weights and widening them in registers,
# is the faster up to its limit of 8 rows against oneDNN's float32 GEMM on the float32 copy.
FEW_ROWS_WIDENED = 8
# On a CPU without AVX-512 (an AVX2 build), linears of up to this many rows run in cpu_gemv.c's
# float32 kernel, whose weights (float32, or bfloat16 widened in registers) are read once for every
# 3 rows of x: faster than oneDNN's float32 GEMM there. With AVX-512 oneDNN is the faster from 4
# rows, and at 1 row the kernel gains little: it is not taken there.
ROWS_F32 = 32
# On a CPU with AMX-BF16, bfloat16 linears of up to this many rows run in cpu_amx.c on weights
# packed into its tiles; from 48 rows the two are within noise or oneDNN's GEMM, which blocks x for
# the caches, is the faster, so mixed and prefill steps keep it. A process that runs both keeps both
# packed copies: three copies of each weight with the arena.
AMX_ROWS = 32


@functools.cache
def rows_kernel_rows() -> int:
    """How many rows of a linear cpu_gemv.c's float32 kernel takes on this CPU (0: none); cached, as
    packed_dtype."""
    return 0 if "avx512f" in cpu_flags() else ROWS_F32


@functools.cache
def few_rows() -> int:
    """How many rows of a bfloat16 linear cpu_gemv.c's bfloat16 kernel takes on this CPU; cached, as
    packed_dtype."""
    return FEW_ROWS if packed_dtype(torch.bfloat16) == torch.bfloat16 else FEW_ROWS_WIDENED


@functools.cache
def small_rows() -> int:
    """The most rows of a linear that any of our kernels (cpu_gemv.c, cpu_amx.c) takes on this CPU
    (more: oneDNN, at once)."""
    return max(few_rows(), rows_kernel_rows(), amx_rows())


@functools.cache
def packed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a weight of this dtype is prepacked in: its own, float32 for bfloat16 on a CPU
    without native bfloat16, or None (not packed: no oneDNN, or a dtype it does not take here)."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dtype == torch.bfloat16 and not (
        has_native_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return torch.float32
    return dtype


def packed(weight: Tensor) -> Tensor | None:
    """weight [out, in] prepacked in packed_dtype (made on first use, then reused), or None where it
    cannot be."""
    if weight.dim() != 2 or weight.device.type != "cpu" or packed_dtype(weight.dtype) is None:
        return None
    return _copy(
        weight,
        "onednn",
        lambda w: torch.ops.mkldnn._reorder_linear_weight(
            w.detach().to(packed_dtype(w.dtype)).contiguous(), None
        ),
    )


@functools.cache
def amx_rows() -> int:
    """How many rows of a bfloat16 linear run on AMX in cpu_amx.c (0: none: no AMX-BF16 on this CPU,
    or hidden by $PPD_CPU_ISA, no kernels, or the OS refused this process AMX's tiles); cached,
    as packed_dtype."""
    if "amx_bf16" not in cpu_flags() or packed_dtype(torch.bfloat16) != torch.bfloat16:
        return 0
    kernels = load()
    return AMX_ROWS if kernels is not None and kernels.lib.amx_ready() == 1 else 0


def forget_cpu_decisions() -> None:
    """Clear the cached per-CPU decisions above, so that the next linear reads $PPD_CPU_ISA again
    (tests)."""
    for decision in (packed_dtype, rows_kernel_rows, few_rows, amx_rows, small_rows):
        decision.cache_clear()


def amx_packed(weight: Tensor) -> Tensor | None:
    """weight [out, in] bfloat16 packed into AMX tiles (made on first use, then reused), or None
    where it cannot be (a shape the kernel does not take: out not a multiple of 16, in of 32)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        return None
    return _copy(weight, "amx", lambda w: load().amx_pack(w))


def _copy(weight: Tensor, kind: str, make) -> Tensor | None:
    """The copy of weight that make(weight) returns, made once per process and kept while weight
    lives."""
    key = (kind, id(weight))
    entry = _packed.get(key)
    if entry is not None and entry[0]() is weight:
        return entry[1]
    with _lock:  # the runners of a process (the prefill thread's too) pack each weight once
        entry = _packed.get(key)
        if entry is None or entry[0]() is not weight:
            entry = _packed[key] = (
                weakref.ref(weight, lambda _, key=key: _packed.pop(key, None)),
                make(weight),
            )
    return entry[1]


def rope_takes(positions: Tensor, cos: Tensor, *xs: Tensor) -> bool:
    """Whether the RoPE kernels (rope, rope_store_kv) take these [T, heads, D] tensors: one dtype of
    theirs, on the CPU, each token's heads and dimensions contiguous; int64 positions and float32
    tables of D/2."""
    return (
        xs[0].dtype in DTYPES
        and all(x.dtype == xs[0].dtype for x in xs)
        and xs[0].device.type == "cpu"
        and positions.dtype == torch.int64
        and cos.dtype == torch.float32
        and cos.shape[-1] * 2 == xs[0].shape[-1]
        and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in xs)
    )


def _fusable(*tensors: Tensor) -> bool:
    return all(
        t.dtype in DTYPES
        and t.dtype == tensors[0].dtype
        and t.device.type == "cpu"
        and t.is_contiguous()
        for t in tensors
    )


class CpuOps(TorchOps):
    """Linear layers on prepacked weights; RMSNorm, SiLU-and-multiply and RoPE in our fused kernels
    (cpu_elementwise.c) where they are built, for float32 and bfloat16."""

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        kernels = load()
        if kernels is None or not _fusable(x, weight) or weight.shape != x.shape[-1:]:
            return TorchOps.rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)[0]

    @staticmethod
    def add_rms_norm(
        x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        kernels = load()
        if (
            kernels is None
            or not _fusable(x, residual, weight)
            or residual.shape != x.shape
            or weight.shape != x.shape[-1:]
        ):
            return TorchOps.add_rms_norm(x, residual, weight, eps)
        return kernels.rms_norm(x, weight, eps, residual)

    @staticmethod
    def silu_and_mul(x: Tensor) -> Tensor:
        kernels = load()
        if kernels is None or not _fusable(x) or x.shape[-1] % 2:
            return TorchOps.silu_and_mul(x)
        return kernels.silu_mul(x)

    @staticmethod
    def apply_rope(
        q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        kernels = load()
        if kernels is None or not rope_takes(positions, cos, q, k):
            return TorchOps.apply_rope(q, k, positions, cos, sin)
        return kernels.rope(q, positions, cos, sin), kernels.rope(k, positions, cos, sin)

    @staticmethod
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= small_rows():
            out = CpuOps.linear_small(x, weight, bias)
            if out is not None:
                return out
        w = packed(weight) if x.shape[0] and x.dim() == 2 and x.dtype == weight.dtype else None
        if w is None:
            return F.linear(x, weight, bias)
        if w.dtype != x.dtype:  # bfloat16 in float32 (no native bfloat16)
            wide = None if bias is None else bias.to(w.dtype)
            return torch.ops.mkldnn._linear_pointwise(
                x.to(w.dtype).contiguous(), w, wide, "none", [], ""
            ).to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")

    @staticmethod
    def linear_small(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
        """x [M, K] of up to small_rows() rows through cpu_amx.c or cpu_gemv.c where they take them,
        else None."""
        if (
            x.dtype == weight.dtype == torch.bfloat16
            and x.shape[0] <= amx_rows()
            and (
                bias is None
                or (
                    bias.dtype == x.dtype
                    and bias.shape == weight.shape[:1]
                    and bias.is_contiguous()
                )
            )
            and (tiles := amx_packed(weight)) is not None
            and weight.shape[1] == x.shape[1]
        ):
            out = load().amx_linear(x.contiguous(), tiles, weight.shape[0], bias)
            if out is not None:
                return out
        few = few_rows()
        if (
            x.dim() == 2
            and 0 < x.shape[0] <= few
            and x.dtype == weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.shape[1] == x.shape[1]
            and weight.is_contiguous()
            and (
                bias is None
                or (
                    bias.dtype == x.dtype
                    and bias.shape == weight.shape[:1]
                    and bias.is_contiguous()
                )
            )
        ):
            kernels = load()
            out = (
                kernels.linear_few_rows(x.contiguous(), weight, bias)
                if kernels is not None
                else None
            )
            if out is not None:
                return out
        if (
            x.dim() == 2
            and 0 < x.shape[0] <= ROWS_F32
            and x.dtype == weight.dtype
            and (x.dtype == torch.float32 or packed_dtype(x.dtype) == torch.float32)
            and x.shape[0] <= rows_kernel_rows()
            and weight.dim() == 2
            and weight.shape[1] == x.shape[1]
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1]))
        ):
            kernels = load()
            wide = None if bias is None else bias.float().contiguous()
            out = (
                kernels.linear_rows(x.float().contiguous(), weight, wide)
                if kernels is not None
                else None
            )
            if out is not None:
                return out.to(x.dtype)
        return None
