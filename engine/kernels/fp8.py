"""FP8 (e4m3) linear layers on the GPU: activations quantized per token and group in one launch,
then a GEMM over the e4m3 weight (engine/quant.py's layout and torch reference, which these match).

- quantize_activations: x [M, K] -> e4m3 [M, K] and float32 scales [M, G], byte for byte
  engine.quant.quantize (IEEE float32 division, then one round-to-nearest-even into e4m3, done in
  float32 arithmetic so that Triton's interpreter, whose float8 cast does not round to even, gives
  the GPU's bytes).
- fp8_gemm: out [M, N] = sum over groups g of (xq_g . wq_g) * xs[m, g] * ws[n, g] (+ bias), in x's
  dtype. W8A8 (activations "dynamic"): FP8 tl.dot; on sm_90 the tensor cores sum a K tile in
  reduced precision, and each tile's sum is added to the float32 accumulator
  (max_num_imprecise_acc = BLOCK_K, DeepSeek-V3's promotion interval of 128). W8A16 ("none"): the
  weight tile converted to x's dtype, dot with float32 accumulation. A K tile never straddles two
  groups (BLOCK_K divides the group), so each tile's dot is scaled by its group's scales; one group
  (per-output-channel scales) is scaled once, after the loop.
- fp8_linear: the layer. W8A8 with one group and bfloat16 x on a Hopper-or-later GPU goes to
  torch._scaled_mm's row-wise scaling (cuBLASLt or CUTLASS) after the quantizing launch; every other
  case to fp8_gemm.

Grids are tiles of the output (and rows x groups for the quantizer): they depend on shapes only,
never on the data or on the SM count, so CUDA graphs capture them and a green-context share of the
SMs runs them. Tiles follow M (FP8_CONFIGS).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine import quant
from engine.kernels.attention import dot_types
from engine.kernels.launch import Consts, Launches, cdiv, launch, next_power_of_2
from engine.quant import FP8, FP8_MAX, MIN_SCALE, Fp8Weight

# A quantizer program's tile: whole groups up to QUANT_WIDTH columns, as many as fill QUANT_TILE (a
# row's 128-column groups eight at a time, a per-channel row of 4096 whole); a wider group (a
# per-channel row of 14336) is read twice, QUANT_WIDTH columns at a time.
QUANT_WIDTH = 4096
QUANT_TILE = 1024
GROUP_M = 8  # M tiles that take the N tiles in turn, so that a weight tile is read from L2
MIN_BLOCK_K = 32  # an FP8 dot's least K (an mma.sync or wgmma instruction's)


@dataclass(frozen=True)
class Fp8Config:
    """The GEMM's tile for up to max_m rows."""

    max_m: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Up to 128 rows a GEMM reads its weight once and is bound by memory: narrow N tiles give
# Llama-3.1-8B's narrowest weight (4096 rows) 128 programs, about one per SM, and deep pipelines
# keep the reads in flight; decode's 16-row tiles take mma.sync, from 17 rows wgmma's 64 (a warp
# group). From 129, square tiles reuse each weight tile over 128 rows. K tiles of 128 are a block
# checkpoint's group. Chosen from the shape of the work, not yet timed on a GPU (bench/fp8_gemm.py
# times them); `python -m tests.engine.kernels.sm90_compile --part fp8-gemm` proves they fit
# sm_90's shared memory.
FP8_CONFIGS = (
    Fp8Config(16, 16, 32, 128, 4, 6),
    Fp8Config(128, 64, 32, 128, 4, 4),
    Fp8Config(1 << 62, 128, 128, 128, 8, 3),
)


def fp8_config(m: int, dtype: torch.dtype, activations: str) -> Fp8Config:
    """The tile for m rows; W8A16 float32's K tiles halved (four bytes an element of x)."""
    config = next(c for c in FP8_CONFIGS if m <= c.max_m)
    if activations == "none" and dtype == torch.float32:
        return replace(config, block_k=config.block_k // 2)
    return config


@triton.jit
def _round_to_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, still float32 (so
    that the cast to e4m3 after it is exact)."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # normal range (from 2^-6): keep 3 of float32's 23 mantissa bits, rounding to even
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000
    a = magnitude.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9, float32's spacing just above 2^14
    small = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, small, normal.to(tl.float32, bitcast=True))
    return tl.where(bits < 0, -r, r)  # by the sign bit: -0.0 stays -0.0


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    G,
    group,
    stride_x,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    GROUPS: tl.constexpr,
    WIDTH: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if ONE_CHUNK:  # GROUPS whole groups, one a row of the tile: x is read once
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        j = tl.arange(0, WIDTH)
        cols = g[:, None] * group + j[None, :]
        mask = (g[:, None] < G) & (j[None, :] < group) & (cols < K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)
        tl.store(s_ptr + row * G + g, scale, mask=g < G)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * K + cols, _round_to_e4m3(y).to(tl.float8e4nv), mask=mask)
    else:  # one group wider than a tile: its absolute maximum, then its values, WIDTH at a time
        g = tl.program_id(1)
        offs = tl.arange(0, WIDTH)
        amax = tl.zeros([WIDTH], dtype=tl.float32)
        for c in range(0, group, WIDTH):
            cols = g * group + c + offs
            mask = (c + offs < group) & (cols < K)
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
        tl.store(s_ptr + row * G + g, scale)
        for c in range(0, group, WIDTH):
            cols = g * group + c + offs
            mask = (c + offs < group) & (cols < K)
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * K + cols, _round_to_e4m3(y).to(tl.float8e4nv), mask=mask)


@triton.jit
def _gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_xs,
    stride_w,
    stride_ws,
    stride_out,
    QUANT_X: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    TILES_PER_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IMPRECISE: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_band = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = pid // per_band * GROUP_M
    band = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + pid % per_band % band
    tile_n = pid % per_band // band
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_in, col_in = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_in = ks < K - kt * BLOCK_K
        a = tl.load(x_ptrs, mask=row_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_in[:, None] & col_in[None, :], other=0.0)
        if not QUANT_X:
            a = a.to(DOT_DTYPE)
            b = b.to(DOT_DTYPE)
        if ONE_GROUP:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, max_num_imprecise_acc=IMPRECISE)
        else:
            g = kt // TILES_PER_GROUP
            scale = tl.load(ws_ptr + cols * stride_ws + g, mask=col_in, other=0.0)[None, :]
            if QUANT_X:
                scale = (
                    tl.load(xs_ptr + rows * stride_xs + g, mask=row_in, other=0.0)[:, None] * scale
                )
            part = tl.dot(a, b, input_precision=DOT_PRECISION, max_num_imprecise_acc=IMPRECISE)
            acc += part * scale
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if ONE_GROUP:
        if QUANT_X:
            acc = acc * tl.load(xs_ptr + rows * stride_xs, mask=row_in, other=0.0)[:, None]
        acc = acc * tl.load(ws_ptr + cols * stride_ws, mask=col_in, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@lru_cache(maxsize=None)
def _quantize_launch(width: int, groups: int) -> tuple[int, Consts]:
    """(programs per row, constants) for groups of width columns (at most K), groups of them."""
    one_chunk = width <= QUANT_WIDTH
    tile_width = next_power_of_2(width) if one_chunk else QUANT_WIDTH
    per_program = min(max(QUANT_TILE // tile_width, 1), next_power_of_2(groups))
    return cdiv(groups, per_program), Consts(
        FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE,
        GROUPS=per_program,
        WIDTH=tile_width,
        ONE_CHUNK=one_chunk,
        num_warps=min(max(per_program * tile_width // 512, 1), 8),
    )


def quantize_activations(
    x: Tensor, group: int, *, launches: Launches | None = None
) -> tuple[Tensor, Tensor]:
    """x [M, K] (bfloat16, float16 or float32, contiguous last dim) -> (e4m3 [M, K], float32
    scales [M, ceil(K / group)]): engine.quant.quantize's bytes, in one launch."""
    m, k = x.shape
    assert x.stride(1) == 1, "x needs a contiguous last dim"
    groups = cdiv(k, group)
    data = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m and k:
        programs, consts = _quantize_launch(min(group, k), groups)
        launch(
            launches,
            _quantize_kernel,
            (m, programs),
            (x, data, scale),
            (k, groups, group, x.stride(0)),
            consts,
        )
    return data, scale


def tile_k(config: Fp8Config, w: Fp8Weight) -> int | None:
    """The GEMM's K tile for w: config's, or with several groups the largest power of two that
    divides the group (at most config's); None where that is under MIN_BLOCK_K."""
    if w.scale.shape[1] == 1:
        return config.block_k
    block_k = min(config.block_k, w.group & -w.group)
    return block_k if block_k >= MIN_BLOCK_K else None


@lru_cache(maxsize=None)
def _gemm_consts(
    config: Fp8Config,
    block_k: int,
    dtype: torch.dtype,
    quant_x: bool,
    one_group: bool,
    tiles_per_group: int,
    has_bias: bool,
) -> Consts:
    dot_dtype, precision = (tl.float8e4nv, "ieee") if quant_x else dot_types(dtype)
    return Consts(
        QUANT_X=quant_x,
        ONE_GROUP=one_group,
        TILES_PER_GROUP=tiles_per_group,
        HAS_BIAS=has_bias,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        GROUP_M=GROUP_M,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        IMPRECISE=block_k if quant_x else 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fp8_gemm(
    x: Tensor,
    w: Fp8Weight,
    bias: Tensor | None = None,
    *,
    config: Fp8Config | None = None,
    launches: Launches | None = None,
) -> Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype through the Triton GEMM, for either
    activations and any number of groups (a group narrower than MIN_BLOCK_K, or not a multiple
    of it, goes to the torch reference). config: the tile (default: fp8_config's for M)."""
    m, k = x.shape
    n = w.data.shape[0]
    assert w.data.shape[1] == k and x.stride(1) == 1 and w.data.stride(1) == 1, "x [M, K], w [N, K]"
    assert w.scale.dtype == torch.float32 and w.scale.stride(1) == 1, "scales [N, G] float32"
    quant_x = w.activations == "dynamic"
    config = config or fp8_config(m, x.dtype, w.activations)
    block_k = tile_k(config, w)
    if block_k is None:
        return quant.fp8_linear(x, w, bias)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    a, xs = quantize_activations(x, w.group, launches=launches) if quant_x else (x, w.scale)
    one_group = w.scale.shape[1] == 1
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n),)
    launch(
        launches,
        _gemm_kernel,
        grid,
        (a, xs, w.data, w.scale, bias if bias is not None else w.scale, out),
        (m, n, k, a.stride(0), xs.stride(0), w.data.stride(0), w.scale.stride(0), out.stride(0)),
        _gemm_consts(
            config,
            block_k,
            x.dtype,
            quant_x,
            one_group,
            1 if one_group else w.group // block_k,
            bias is not None,
        ),
    )
    return out


@lru_cache(maxsize=None)
def _has_rowwise_fp8(device: torch.device) -> bool:
    """torch._scaled_mm's row-wise scaling runs here (compute capability 9.0 on; 8.9's CUTLASS path
    is not relied on)."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def scaled_mm_serves(x: Tensor, w: Fp8Weight, bias: Tensor | None = None) -> bool:
    """Whether torch._scaled_mm's row-wise scaling takes this layer: one group, bfloat16 out (the
    only row-wise output sm_90's kernels are known to give), K and N multiples of 16, the weight
    row-major (so its transpose is column-major), its scales [N, 1] contiguous, a bias in
    bfloat16."""
    n, k = w.data.shape
    return (
        w.activations == "dynamic"
        and x.dtype == torch.bfloat16
        and w.scale.shape[1] == 1
        and w.scale.dtype == torch.float32
        and w.scale.is_contiguous()
        and k % 16 == 0
        and n % 16 == 0
        and w.data.stride(1) == 1
        and w.data.stride(0) % 16 == 0
        and (bias is None or bias.dtype == torch.bfloat16)
    )


def scaled_mm_linear(
    x: Tensor, w: Fp8Weight, bias: Tensor | None = None, *, launches: Launches | None = None
) -> Tensor:
    """The W8A8 layer through torch._scaled_mm (where scaled_mm_serves): x quantized per token,
    then one scaled GEMM with the bias in its epilogue."""
    xq, xs = quantize_activations(x, w.group, launches=launches)
    return torch._scaled_mm(
        xq, w.data.t(), scale_a=xs, scale_b=w.scale.t(), bias=bias, out_dtype=x.dtype
    )


def fp8_linear(
    x: Tensor, w: Fp8Weight, bias: Tensor | None = None, *, launches: Launches | None = None
) -> Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype, as engine.quant.fp8_linear computes it:
    torch._scaled_mm where it serves the layout on a GPU, else the Triton GEMM. launches: the
    step's (engine/kernels/launch.py)."""
    if x.is_cuda and scaled_mm_serves(x, w, bias) and _has_rowwise_fp8(x.device):
        return scaled_mm_linear(x, w, bias, launches=launches)
    return fp8_gemm(x, w, bias, launches=launches)
