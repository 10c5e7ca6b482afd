"""A mixture-of-experts layer on the GPU in six Triton launches after the router's GEMM: route,
align, a grouped GEMM over the stacked experts for gate|up, silu_and_mul, a grouped GEMM for down,
the top-k sum.

- route: per token, the softmax over the router's logits in float32, the top_k experts and their
  weights (renormalised where the model says), as engine/ops.py's route computes them.
- align: the T * top_k (token, expert) entries grouped by expert in one program (a counting sort,
  stable: an expert's entries in token order), each expert's run padded to the GEMM's BLOCK_M rows
  with the sentinel T * top_k, so that every BLOCK_M-row block of the sorted order belongs to one
  expert; the padded count stays on the device.
- the grouped GEMM: program (m, n) multiplies its block's rows (entries; for gate|up, the rows of x
  their tokens are) by its block's expert's weight [N, K], reading only the experts some entry
  chose; the down GEMM multiplies each entry's row by its routing weight in its epilogue.
- the sum: each token's top_k weighted rows added in float32 and rounded once.

Grids depend only on T (an upper bound on the padded rows: T * top_k plus BLOCK_M - 1 for each
expert that can hold an entry), never on the routing, and the blocks past the padded count return
at once: decode and token-bucket CUDA graphs capture the layer whole. Tile sizes follow the entry
count (MOE_CONFIGS).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.activation import silu_and_mul
from engine.kernels.attention import dot_types
from engine.kernels.launch import Consts, Launches, cdiv, launch, next_power_of_2

ALIGN_CHUNK = 128  # entries (or positions) the align program takes at a time
SUM_BLOCK = 1024  # output columns per program of the top-k sum


@dataclass(frozen=True)
class MoeConfig:
    """The grouped GEMM's tile for entry counts up to max_entries."""

    max_entries: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# By entries (tokens x top_k): few entries (decode) take 16-row blocks, as each expert's run is
# short and its weight is what is read; a prefill's runs fill 64- and 128-row tiles. Chosen from the
# shape of the work, not yet timed on a GPU (`python -m bench.kernels --only moe` sweeps them).
MOE_CONFIGS = (
    MoeConfig(64, 16, 64, 128, 4, 4),
    MoeConfig(1024, 32, 64, 64, 4, 4),
    MoeConfig(8192, 64, 128, 64, 4, 3),
    MoeConfig(1 << 62, 128, 128, 64, 8, 3),
)


def moe_config(entries: int, dtype: torch.dtype) -> MoeConfig:
    """The tile for this many entries; float32's K tiles halved (twice the bytes an element)."""
    config = next(c for c in MOE_CONFIGS if entries <= c.max_entries)
    return replace(config, block_k=config.block_k // 2) if dtype == torch.float32 else config


def padded_rows(entries: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the aligned rows, a whole number of blocks: each expert that can hold an
    entry pads its run by at most block_m - 1."""
    return cdiv(entries + min(num_experts, entries) * (block_m - 1), block_m) * block_m


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_POW2)
    x = tl.load(
        logits_ptr + token * stride_logits + experts, mask=experts < E, other=-float("inf")
    ).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(experts < E, p, -1.0)
    slots = tl.arange(0, K_POW2)
    values = tl.zeros([K_POW2], dtype=tl.float32)
    chosen = tl.zeros([K_POW2], dtype=tl.int64)
    for j in tl.static_range(TOP_K):  # the largest left, the lowest index among equals
        best = tl.max(p, axis=0)
        expert = tl.min(tl.where(p == best, experts, E_POW2), axis=0)
        values = tl.where(slots == j, best, values)
        chosen = tl.where(slots == j, expert.to(tl.int64), chosen)
        p = tl.where(experts == expert, -1.0, p)
    if RENORMALIZE:
        values = values / tl.sum(values, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, values, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen, mask=slots < TOP_K)


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_entries,
    num_rows,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], tl.int32)
    for start in range(0, num_entries, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_entries, other=E_POW2).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Each row's expert is the number of runs that end at or before it. A block takes its first
    # row's (blocks past the padded count, which return at once, the last expert); a row is padding
    # past its expert's entries, or past every run.
    for start in range(0, num_rows, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        own = experts[None, :] == expert[:, None]
        first = tl.sum(tl.where(own, starts[None, :], 0), axis=1)
        count = tl.sum(tl.where(own, counts[None, :], 0), axis=1)
        inside = rows < num_rows
        tl.store(sorted_ptr + rows, num_entries, mask=inside & (rows - first >= count))
        tl.store(
            block_expert_ptr + rows // BLOCK_M,
            tl.minimum(expert, E - 1),
            mask=inside & (rows % BLOCK_M == 0),
        )
    # The entries in order: each goes after its expert's earlier ones (a running count per
    # expert, and the rank within the chunk by a prefix sum of the one-hot rows).
    taken = tl.zeros([E_POW2], tl.int32)
    for start in range(0, num_entries, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_entries, other=E_POW2).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1
        row = tl.sum(onehot * (starts + taken)[None, :] + onehot * rank, axis=1)
        tl.store(sorted_ptr + row, offs, mask=offs < num_entries)
        taken += tl.sum(onehot, axis=0)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    weights_ptr,
    num_entries,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    ROWS_PER_A: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):  # the grid's bound overshoots the routing's
        return
    entries = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entries < num_entries
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    # an entry's row of a: its token's for gate|up (ROWS_PER_A = top_k), its own for down
    a_rows = (entries // ROWS_PER_A).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + entries, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + entries.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _topk_sum_kernel(c_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(c_ptr + (token * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def _route_consts(num_experts: int, top_k: int, renormalize: bool) -> Consts:
    e_pow2 = next_power_of_2(num_experts)
    return Consts(
        E=num_experts,
        E_POW2=e_pow2,
        TOP_K=top_k,
        K_POW2=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        num_warps=min(max(e_pow2 // 64, 1), 4),
    )


def route(
    logits: Tensor, top_k: int, renormalize: bool, *, launches: Launches | None = None
) -> tuple[Tensor, Tensor]:
    """engine/ops.py's route in one launch: (weights [T, top_k] float32, ids [T, top_k] int64)."""
    t, e = logits.shape
    assert logits.stride(1) == 1, "logits need a contiguous last dim"
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        launch(
            launches,
            _route_kernel,
            (t,),
            (logits, weights, ids),
            (logits.stride(0),),
            _route_consts(e, top_k, renormalize),
        )
    return weights, ids


@dataclass(frozen=True)
class Alignment:
    """The entries grouped by expert: sorted [rows] int32 (each row's entry, or the sentinel
    num_entries), block_expert [rows / block_m] int32, num_padded [1] int32 (on the device)."""

    sorted: Tensor
    block_expert: Tensor
    num_padded: Tensor
    block_m: int


@lru_cache(maxsize=None)
def _align_consts(num_experts: int, block_m: int) -> Consts:
    return Consts(
        E=num_experts,
        E_POW2=next_power_of_2(num_experts),
        BLOCK_M=block_m,
        CHUNK=ALIGN_CHUNK,
        num_warps=4,
    )


def align(
    ids: Tensor, num_experts: int, block_m: int, *, launches: Launches | None = None
) -> Alignment:
    """Group ids' entries (row-major: token t's j-th choice is entry t * top_k + j) by expert,
    each expert's run padded to a multiple of block_m."""
    entries = ids.numel()
    rows = padded_rows(entries, num_experts, block_m)
    device = ids.device
    out = Alignment(
        torch.empty(rows, dtype=torch.int32, device=device),
        torch.empty(rows // block_m, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
        block_m,
    )
    launch(
        launches,
        _align_kernel,
        (1,),
        (ids, out.sorted, out.block_expert, out.num_padded),
        (entries, rows),
        _align_consts(num_experts, block_m),
    )
    return out


@lru_cache(maxsize=None)
def _gemm_consts(config: MoeConfig, dtype: torch.dtype, rows_per_a: int, mul: bool) -> Consts:
    dot_dtype, precision = dot_types(dtype)
    return Consts(
        ROWS_PER_A=rows_per_a,
        MUL_WEIGHTS=mul,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def grouped_gemm(
    a: Tensor,
    w: Tensor,
    aligned: Alignment,
    num_entries: int,
    config: MoeConfig,
    *,
    rows_per_a: int = 1,
    weights: Tensor | None = None,
    launches: Launches | None = None,
) -> Tensor:
    """c [num_entries, N]: entry i's row of a (row i // rows_per_a) times its expert's w[e].T
    ([E, N, K], contiguous rows), times weights[i] if given."""
    n, k = w.shape[1], w.shape[2]
    assert a.shape[1] == k and a.stride(1) == 1 and w.stride(2) == 1, "a [*, K], w [E, N, K]"
    c = torch.empty(num_entries, n, dtype=a.dtype, device=a.device)
    grid = (aligned.sorted.numel() // config.block_m, cdiv(n, config.block_n))
    launch(
        launches,
        _grouped_gemm_kernel,
        grid,
        (
            a,
            w,
            c,
            aligned.sorted,
            aligned.block_expert,
            aligned.num_padded,
            weights if weights is not None else aligned.num_padded,
        ),
        (num_entries, n, k, a.stride(0), w.stride(0), w.stride(1), c.stride(0)),
        _gemm_consts(config, a.dtype, rows_per_a, weights is not None),
    )
    return c


@lru_cache(maxsize=None)
def _sum_consts(hidden: int, top_k: int) -> tuple[int, Consts]:
    block = min(next_power_of_2(hidden), SUM_BLOCK)
    return cdiv(hidden, block), Consts(
        TOP_K=top_k, BLOCK=block, num_warps=min(max(block // 256, 1), 8)
    )


def fused_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    weights: Tensor,
    ids: Tensor,
    *,
    config: MoeConfig | None = None,
    launches: Launches | None = None,
) -> Tensor:
    """The layer's output [T, H] for x [T, H] routed to ids [T, top_k] with weights [T, top_k]
    float32: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]. config: the grouped GEMMs' tile
    (default: moe_config's for the entry count; bench/kernels.py sweeps others)."""
    t, hidden = x.shape
    top_k, entries = ids.shape[1], ids.numel()
    out = torch.empty_like(x)
    if t == 0:
        return out
    config = config or moe_config(entries, x.dtype)
    aligned = align(ids, w13.shape[0], config.block_m, launches=launches)
    gate_up = grouped_gemm(x, w13, aligned, entries, config, rows_per_a=top_k, launches=launches)
    down = grouped_gemm(
        silu_and_mul(gate_up, launches=launches),
        w2,
        aligned,
        entries,
        config,
        weights=weights,
        launches=launches,
    )
    programs, consts = _sum_consts(hidden, top_k)
    launch(launches, _topk_sum_kernel, (t, programs), (down, out), (hidden,), consts)
    return out
