"""Paged attention for mixed batches: one tile program for full prefill, append-prefill over a
cached prefix and decode, launched on a decode grid, a general grid, or both grids in one launch.

Contract: new token j of sequence b (n_b = query_start[b+1] - query_start[b] new tokens) sits at
absolute position seq_lens[b] - n_b + j and attends keys 0..that position, read from the paged cache
through block_tables (key p lives at slot block_tables[b, p // block_size] * block_size + p %
block_size). Query head h reads KV head h // (H // Hkv). A sequence with seq_lens[b] == 0 (a padding
row) gets zeros. Every row of `out` is written; no key at or past seq_lens[b] is read, and no
block-table entry past its last used block.

Layout of a program's tile (GQA packing, as vLLM's unified attention): BLOCK_M rows = BLOCK_Q query
tokens x the G query heads sharing one KV head, so each K/V tile is loaded once per KV head and
tl.dot runs even in decode. Grids depend only on shapes and host ints, never on seq_lens values, so
a captured CUDA graph stays valid:
- general path: (T // BLOCK_Q + B, Hkv, num_splits); a program finds its sequence by binary search
  over query_start. The sequences' new tokens may start past token 0 of q (query_start[0] > 0): a
  step's decodes run on the decode grid and its other sequences, after them in q, on the general
  grid with query_start and seq_lens sliced. num_splits > 1 (an append over a long cached prefix,
  whose few query tiles would leave SMs idle: choose_append_splits) splits each query tile's keys
  across programs.
- decode (max_query_len == 1): (B, Hkv, num_splits); num_splits > 1 (choose_num_splits) splits each
  sequence's keys.
- mixed (plan_mixed_attention): both grids in one launch, (B_decode x decode splits + (T // BLOCK_Q
  + B_general) x splits, Hkv): the first programs take the decode role, the rest the general role,
  each with its own tile. A split takes an equal share of its tile's key tiles (counted on the
  device from seq_lens; past a short sequence's keys a split is empty) and writes a float32 partial
  output and log-sum-exp; a second kernel merges them.

An fp8 (e4m3) cache (its pointers' element type, known when the kernel compiles) holds keys and
values divided by the layer's k_scale and v_scale (store_kv.py): a tile loads them in the dot's
dtype (exact), k_scale folds into the scores' scale (qk_scale) and v_scale multiplies each output
row, or split partial, once. Both are runtime arguments, the kernel's first scalars
(AttentionLaunch.scaled_args), so that layers of different scales share one compiled kernel.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.launch import Consts, Launches, cdiv, next_power_of_2

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: kernels may read only constexpr globals
MIN_KEYS_PER_SPLIT = (
    256  # a split shorter than this costs more in merge traffic and launch than it saves
)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch knobs of one attention launch (bench/kernels.py sweeps them)."""

    block_m: (
        int  # rows of a program's tile (query tokens x query heads per KV head); power of two >= 16
    )
    tile_n: int  # keys per inner-loop step; power of two >= 16
    num_warps: int
    num_stages: int


# Decode is bandwidth-bound: one 16-row tile per (sequence, KV head), 64-key steps, loads pipelined
# over 3 stages. Prefill is compute-bound: the smallest tile that holds the longest query (short
# appends waste fewer rows), up to 128 rows with 8 warps (two Hopper warpgroups) and 64-key steps.
# An append over a long cached prefix reads many keys per query row: 64 rows and 128-key steps. The
# two largest entries are the fastest of `bench.kernels`' sweep on an H200
# (docs/gpu.md#measurements-behind-the-code); between 4 and 17 keys per query the choice is
# unmeasured (a long prompt's later chunks: 2,048 new over 6,144 cached is an append here). Compiled
# for sm_90 by Triton 3.9 (bf16, head_dim 128), only the append tile spills registers: a few dozen
# bytes, split or not, alone or mixed. An append's query tiles also split their keys
# (choose_append_splits: toward two programs per SM, at most APPEND_MAX_SPLITS ways); the split
# counts are chosen from the tile's program count, so a new APPEND_CONFIG brings its own. A mixed
# step's single launch runs its decode role on DECODE_CONFIG's tile with the general tile's warps
# and stages.
DECODE_CONFIG = AttentionConfig(block_m=16, tile_n=64, num_warps=4, num_stages=3)
PREFILL_CONFIGS = (
    AttentionConfig(block_m=16, tile_n=64, num_warps=4, num_stages=3),
    AttentionConfig(block_m=32, tile_n=64, num_warps=4, num_stages=3),
    AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3),
    AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=2),
)
APPEND_CONFIG = AttentionConfig(block_m=64, tile_n=128, num_warps=4, num_stages=3)
APPEND_KEYS_PER_QUERY = (
    4  # a step is an append when its longest sequence has this many keys per query or more
)
APPEND_MAX_SPLITS = (
    4  # an append's query tiles split their keys at most this many ways (choose_append_splits)
)


@triton.jit
def _find_seq(query_start_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile tile_idx: sequence b's tiles start at query_start[b] //
    BLOCK_Q + b."""
    # Annotated: the JIT may specialize num_seqs == 1 to a constant, and loop-carried values need
    # one type.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_abs,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    head_offset,
    stride_slot,
    kv_len,
    tile_lo,
    tile_hi,
    qk_scale,
    offs_d,
    d_ok,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi); scores are kept in log2 units (exp2 is one
    instruction)."""
    offs_n = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n
        in_kv = pos < kv_len
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_kv, other=0).to(tl.int64)
        base = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_slot + head_offset
        k = tl.load(
            k_cache_ptr + base[None, :] + offs_d[:, None],
            mask=d_ok[:, None] & in_kv[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + base[:, None] + offs_d[None, :],
            mask=in_kv[:, None] & d_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL_MASK:
            s = tl.where(pos[None, :] <= q_abs[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; exponentiate against 0 so it yields 0, not
        # NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_tile(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    program,
    split,
    num_splits,
    split_kv,
    num_seqs,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_kv_head,
    stride_table,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DECODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Split `split` of num_splits of one tile of KV head program_id(1): sequence `program` (decode)
    or the general grid's query tile `program`. With split_kv (num_splits > 1; a constexpr where
    the launch fixes it) it writes its partial output and log-sum-exp (lse) instead of out, an
    empty split its lse (-inf) alone."""
    kv_head = tl.program_id(1)
    if DECODE:
        seq = program
        q_tile = 0
    else:
        found = _find_seq(query_start_ptr, program, num_seqs, BLOCK_Q)
        seq = tl.maximum(found, 0)
        q_tile = tl.maximum(program - (tl.load(query_start_ptr + seq) // BLOCK_Q + seq), 0)
    q_start = tl.load(query_start_ptr + seq)
    n_new = tl.load(query_start_ptr + seq + 1) - q_start
    if not DECODE:
        # Where the sequences' queries start past token 0 (the general grid over a step's later
        # sequences), the grid's first tiles belong to none.
        n_new = tl.where(found < 0, 0, n_new)
    if (
        q_tile * BLOCK_Q >= n_new
    ):  # the grid's upper bound overshoots by up to one tile per sequence
        return
    kv_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // G
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (q_idx < n_new)
    q_abs = kv_len - n_new + q_idx
    token = (q_start + q_idx).to(tl.int64)

    # Keys [0, first_abs] are visible to every row (no mask); keys up to the last row's position
    # need the mask. A split takes an equal share of the tile's key tiles; past a short sequence's
    # last tile a split is empty.
    first_abs = kv_len - n_new + q_tile * BLOCK_Q
    kv_end = tl.maximum(kv_len - n_new + tl.minimum((q_tile + 1) * BLOCK_Q, n_new), 0)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    full_tiles = tl.maximum(first_abs + 1, 0) // TILE_N
    per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), 1)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    tile_mid = tl.minimum(tl.maximum(full_tiles, tile_lo), tile_hi)
    if split_kv:
        if tile_lo >= tile_hi:  # the merge reads an empty split's lse only
            tl.store(
                part_lse_ptr + token * stride_lt + head * stride_lh + split,
                tl.full([BLOCK_M], float("-inf"), tl.float32),
                mask=row_ok,
            )
            return

    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    table_ptr = table_ptr + seq.to(tl.int64) * stride_table
    head_offset = kv_head * stride_kv_head
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        q_abs,
        k_cache_ptr,
        v_cache_ptr,
        table_ptr,
        head_offset,
        stride_slot,
        kv_len,
        tile_lo,
        tile_mid,
        qk_scale,
        offs_d,
        d_ok,
        TILE_N,
        BLOCK_SIZE,
        False,
        DOT_DTYPE,
        DOT_PRECISION,
    )
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        q_abs,
        k_cache_ptr,
        v_cache_ptr,
        table_ptr,
        head_offset,
        stride_slot,
        kv_len,
        tile_mid,
        tile_hi,
        qk_scale,
        offs_d,
        d_ok,
        TILE_N,
        BLOCK_SIZE,
        True,
        DOT_DTYPE,
        DOT_PRECISION,
    )

    # l == 0 only for a row that saw no key (padding row, a split wholly past its position): zeros,
    # lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
        o = o * v_scale
    mask = row_ok[:, None] & d_ok[None, :]
    if split_kv:
        part = (
            part_out_ptr
            + token[:, None] * stride_pt
            + head[:, None] * stride_ph
            + split * stride_ps
        )
        tl.store(part + offs_d[None, :], o, mask=mask)
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        tl.store(part_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        o_ptr = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=mask)


# A batch's size, its block-table width and its split counts change every step: specializing on them
# (== 1, divisible by 16) would compile new variants on the request path for no gain. The one-grid
# kernel varies with whether it splits (SPLIT_KV: the unsplit tile keeps no partials' code, nor
# their registers) but not with how many ways; the mixed kernel with neither, its roles' partials
# float32 placeholders where they do not split.
_VARYING = [
    "num_seqs",
    "num_splits",
    "stride_table",
    "stride_pt",
    "stride_ph",
    "stride_ps",
    "stride_lt",
    "stride_lh",
]


@triton.jit(do_not_specialize=_VARYING)
def _attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    v_scale,
    num_seqs,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_kv_head,
    stride_table,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DECODE: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One grid: axis 0 its sequences (decode) or query tiles (general), axis 1 the KV heads, axis 2
    the splits."""
    split = tl.program_id(2) if SPLIT_KV else 0
    _attend_tile(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        query_start_ptr,
        seq_lens_ptr,
        part_out_ptr,
        part_lse_ptr,
        tl.program_id(0),
        split,
        num_splits,
        SPLIT_KV,
        num_seqs,
        qk_scale,
        v_scale,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_slot,
        stride_kv_head,
        stride_table,
        stride_pt,
        stride_ph,
        stride_ps,
        stride_lt,
        stride_lh,
        G,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
        BLOCK_M,
        BLOCK_Q,
        TILE_N,
        DECODE,
        DOT_DTYPE,
        DOT_PRECISION,
    )


@triton.jit(
    do_not_specialize=[
        "num_decodes",
        "decode_splits",
        "stride_dpt",
        "stride_dph",
        "stride_dps",
        "stride_dlt",
        "stride_dlh",
        *_VARYING,
    ]
)
def _mixed_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    decode_out_ptr,
    decode_lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    v_scale,
    num_decodes,
    decode_splits,
    num_seqs,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_kv_head,
    stride_table,
    stride_dpt,
    stride_dph,
    stride_dps,
    stride_dlt,
    stride_dlh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DECODE_BLOCK_M: tl.constexpr,
    DECODE_TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The decode and the general grid in one launch: programs [0, num_decodes x decode_splits) of
    axis 0 take the first num_decodes sequences (one token each; each sequence's splits
    adjacent), the rest the general grid's query tiles over the num_seqs sequences after them
    (num_splits each, adjacent); axis 1 the KV heads."""
    p = tl.program_id(0)
    decode_programs = num_decodes * decode_splits
    if p < decode_programs:
        _attend_tile(
            out_ptr,
            q_ptr,
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr,
            query_start_ptr,
            seq_lens_ptr,
            decode_out_ptr,
            decode_lse_ptr,
            p // decode_splits,
            p % decode_splits,
            decode_splits,
            decode_splits > 1,
            num_decodes,
            qk_scale,
            v_scale,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_slot,
            stride_kv_head,
            stride_table,
            stride_dpt,
            stride_dph,
            stride_dps,
            stride_dlt,
            stride_dlh,
            G,
            HEAD_DIM,
            D_PAD,
            BLOCK_SIZE,
            DECODE_BLOCK_M,
            1,
            DECODE_TILE_N,
            True,
            DOT_DTYPE,
            DOT_PRECISION,
        )
    else:
        g = p - decode_programs
        tables_ptr = block_tables_ptr + num_decodes.to(tl.int64) * stride_table
        _attend_tile(
            out_ptr,
            q_ptr,
            k_cache_ptr,
            v_cache_ptr,
            tables_ptr,
            query_start_ptr + num_decodes,
            seq_lens_ptr + num_decodes,
            part_out_ptr,
            part_lse_ptr,
            g // num_splits,
            g % num_splits,
            num_splits,
            num_splits > 1,
            num_seqs,
            qk_scale,
            v_scale,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_slot,
            stride_kv_head,
            stride_table,
            stride_pt,
            stride_ph,
            stride_ps,
            stride_lt,
            stride_lh,
            G,
            HEAD_DIM,
            D_PAD,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_Q,
            TILE_N,
            False,
            DOT_DTYPE,
            DOT_PRECISION,
        )


@triton.jit(do_not_specialize=["first_seq", "first_token"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_ptr,
    first_seq,
    first_token,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """out[t, h] = sum_s exp(lse_s) * o_s / sum_s exp(lse_s) over the non-empty splits (lse_s >
    -inf), for rows t = first_token + program_id(0) from query_start[first_seq] on: rows before
    it are another grid's (in a captured step the general grid's first row follows the step's
    decodes, a count only the device knows)."""
    token = (tl.program_id(0) + first_token).to(tl.int64)
    if token < tl.load(query_start_ptr + first_seq):
        return
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    lse = tl.load(
        part_lse_ptr + token * stride_lt + head * stride_lh + offs_s,
        mask=offs_s < NUM_SPLITS,
        other=float("-inf"),
    )
    live = lse > float("-inf")
    lse_max = tl.max(lse, 0)
    weight = tl.exp(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    # Empty splits' partial rows are never read: the workspace is not cleared between steps.
    part = tl.load(
        part_out_ptr
        + token * stride_pt
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=live[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    o = tl.sum(part * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_num_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132, max_splits: int = 16
) -> int:
    """KV splits per sequence for a decode step: a power of two <= max_splits.

    Without splits a decode step runs batch_size * num_kv_heads programs; split until there are
    about two programs per SM (so every SM streams KV and the tail wave is short), but never into
    splits shorter than MIN_KEYS_PER_SPLIT keys, where the extra partial-result traffic and merge
    launch outweigh the gain. Big batches and short contexts get 1. Powers of two bound the number
    of merge kernel variants.
    """
    return _splits(batch_size * num_kv_heads, max_seq_len, num_sms, max_splits)


def choose_append_splits(
    programs: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int = 132,
    max_splits: int = APPEND_MAX_SPLITS,
) -> int:
    """KV splits per query tile of the general grid: a power of two <= max_splits.

    programs: the grid's query tiles x KV heads (general_programs). An append over a long cached
    prefix makes few tiles, each walking every cached key: split until programs x splits reaches
    about two per SM, never into splits shorter than MIN_KEYS_PER_SPLIT keys, as choose_num_splits
    does for decode. A step that is no append (its longest sequence has fewer than
    APPEND_KEYS_PER_QUERY keys per query: a fresh prompt) gets 1.
    """
    if max_seq_len < APPEND_KEYS_PER_QUERY * max_query_len:
        return 1
    return _splits(programs, max_seq_len, num_sms, max_splits)


def _splits(programs: int, max_seq_len: int, num_sms: int, max_splits: int) -> int:
    wanted = math.ceil(2 * num_sms / max(programs, 1))
    affordable = max_seq_len // MIN_KEYS_PER_SPLIT
    splits = max(min(wanted, affordable, max_splits), 1)
    return 1 << (splits.bit_length() - 1)


def general_programs(
    num_tokens: int, group: int, num_kv_heads: int, config: AttentionConfig
) -> int:
    """The general grid's programs that hold queries, for num_tokens tokens of one sequence with
    this tile (each further sequence adds at most one)."""
    return cdiv(num_tokens, _tile_rows(config, group, False)[1]) * num_kv_heads


def _tile_rows(config: AttentionConfig, group: int, decode: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): the tile's rows, at least the group's heads (padded to a power of two),
    and the query tokens they hold."""
    block_m = max(config.block_m, next_power_of_2(group))
    return block_m, 1 if decode else block_m // group


def workspace_for(
    max_tokens: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Split-KV partial outputs [max_tokens, H, num_splits, D] and their log-sum-exps [max_tokens,
    H, num_splits]."""
    out = torch.empty(
        max_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
    )
    lse = torch.empty(max_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    return out, lse


def default_config(max_query_len: int, group: int, max_seq_len: int = 0) -> AttentionConfig:
    """The config table's entry for a batch: decode; an append whose tile would pass 64 rows (its
    longest sequence, keys included, at least APPEND_KEYS_PER_QUERY x its longest query); else the
    smallest prefill tile holding the longest query. max_seq_len 0: not known (a prefill)."""
    if max_query_len == 1:
        return DECODE_CONFIG
    rows = max_query_len * group
    if rows > APPEND_CONFIG.block_m and max_seq_len >= APPEND_KEYS_PER_QUERY * max_query_len:
        return APPEND_CONFIG
    return next((c for c in PREFILL_CONFIGS if c.block_m >= rows), PREFILL_CONFIGS[-1])


@lru_cache(maxsize=None)
def dot_types(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """tl.dot operand type and precision: tensor cores in the input dtype on a GPU; float32 under
    the interpreter, whose bf16 dot is wrong; IEEE float32 (not TF32) for float32 inputs so they
    match a float32 reference."""
    if os.environ.get("TRITON_INTERPRET") == "1" or dtype == torch.float32:
        return tl.float32, "ieee"
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype], "tf32"


@dataclass(frozen=True)
class Merge:
    """The log-sum-exp merge of one grid's split-KV partials into out: grid (rows, heads) from row
    first_token on."""

    grid: tuple[int, int]
    part: tuple[Tensor, Tensor]
    args: tuple  # the merge kernel's arguments after its four tensors
    consts: Consts


@dataclass(frozen=True)
class AttentionLaunch:
    """What one step's attention launch shares across layers: its kernel, grid, scalar arguments,
    tile constants, split-KV partials and their merges. Layers differ only in their q, out and
    cache tensors, of the strides planned here, and an fp8 cache's scales (scaled_args)."""

    kernel: triton.JITFunction
    grid: tuple[int, ...]
    part: tuple[
        Tensor, ...
    ]  # the kernel's partial outputs and log-sum-exps, a pair per grid (placeholders: no split)
    args: tuple  # the kernel's arguments after its tensors: qk_scale, v_scale (1.0), then the rest
    consts: Consts
    merges: tuple[Merge, ...] = ()

    def scaled_args(self, kv_scales: tuple[float, float]) -> tuple:
        """args for a layer whose fp8 cache has these (k_scale, v_scale)."""
        return (self.args[0] * kv_scales[0], kv_scales[1], *self.args[2:])


def _partials(
    workspace: tuple[Tensor, Tensor] | None,
    t: int,
    h: int,
    d: int,
    splits: int,
    device: torch.device | str,
) -> tuple[tuple[Tensor, Tensor], tuple[int, ...]]:
    """A grid's split-KV partials and their strides (token, head, split of the outputs; token, head
    of the lse): the workspace (allocated if None) where it splits, else zero-size float32
    placeholders that nothing reads."""
    if splits == 1:
        return (torch.empty(0, dtype=torch.float32, device=device),) * 2, (0,) * 5
    part_out, part_lse = workspace or workspace_for(t, h, d, splits, device)
    assert (
        part_out.shape[0] >= t and part_out.shape[1:] == (h, splits, d) and part_out.stride(3) == 1
    )
    assert part_lse.shape[0] >= t and part_lse.shape[1:] == (h, splits) and part_lse.stride(2) == 1
    return (part_out, part_lse), (*part_out.stride()[:3], *part_lse.stride()[:2])


def _merge(
    rows: int,
    first_seq: int,
    first_token: int,
    splits: int,
    part: tuple[Tensor, Tensor],
    part_strides: tuple[int, ...],
    out_strides: tuple[int, int],
    h: int,
    d: int,
) -> Merge:
    consts = Consts(
        NUM_SPLITS=splits,
        S_PAD=next_power_of_2(splits),
        HEAD_DIM=d,
        D_PAD=next_power_of_2(d),
        num_warps=4 if d >= 128 else 1,
    )
    return Merge((rows, h), part, (first_seq, first_token, *out_strides, *part_strides), consts)


def _shared_consts(group: int, d: int, block_size: int, dtype: torch.dtype) -> dict:
    dot_dtype, dot_precision = dot_types(dtype)
    return dict(
        G=group,
        HEAD_DIM=d,
        D_PAD=max(next_power_of_2(d), 16),
        BLOCK_SIZE=block_size,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
    )


def plan_attention(
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    num_seqs: int,
    dtype: torch.dtype,
    *,
    q_strides: tuple[int, int],
    out_strides: tuple[int, int],
    cache_strides: tuple[int, int],
    table_stride: int,
    num_kv_heads: int,
    block_size: int,
    scale: float,
    max_query_len: int,
    max_seq_len: int = 0,
    num_splits: int = 1,
    workspace: tuple[Tensor, Tensor] | None = None,
    first_token: int = 0,
    config: AttentionConfig | None = None,
    device: torch.device | str = "cuda",
) -> AttentionLaunch:
    """The launch of paged_attention for a step of this shape (see paged_attention for the
    arguments); strides are (token, head) of q and out, (slot, head) of the caches, and the block
    table's row stride. first_token: the grid's first row (a general grid after a step's decodes;
    0 where only the device knows it, in a graph), from which its split-KV merge runs."""
    t, h, d, b, hkv = num_tokens, num_heads, head_dim, num_seqs, num_kv_heads
    group = h // hkv
    decode = max_query_len == 1
    cfg = config or default_config(max_query_len, group, max_seq_len)
    block_m, block_q = _tile_rows(cfg, group, decode)
    part, part_strides = _partials(workspace, t, h, d, num_splits, device)
    consts = Consts(
        **_shared_consts(group, d, block_size, dtype),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg.tile_n,
        DECODE=decode,
        SPLIT_KV=num_splits > 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    merges = ()
    if num_splits > 1:
        merges = (
            _merge(
                t - first_token, 0, first_token, num_splits, part, part_strides, out_strides, h, d
            ),
        )
    return AttentionLaunch(
        _attention_kernel,
        (b if decode else t // block_q + b, hkv, num_splits),
        part,
        (
            scale * LOG2E,
            1.0,
            b,
            num_splits,
            *q_strides,
            *out_strides,
            *cache_strides,
            table_stride,
            *part_strides,
        ),
        consts,
        merges,
    )


def plan_mixed_attention(
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    num_seqs: int,
    dtype: torch.dtype,
    *,
    q_strides: tuple[int, int],
    out_strides: tuple[int, int],
    cache_strides: tuple[int, int],
    table_stride: int,
    num_kv_heads: int,
    block_size: int,
    scale: float,
    num_decodes: int,
    decode_tokens: int,
    decode_splits: int = 1,
    decode_workspace: tuple[Tensor, Tensor] | None = None,
    max_query_len: int,
    max_seq_len: int = 0,
    num_splits: int = 1,
    workspace: tuple[Tensor, Tensor] | None = None,
    config: AttentionConfig | None = None,
    device: torch.device | str = "cuda",
) -> AttentionLaunch:
    """A mixed step's two grids in one launch (its kernel's programs take either role): sequences
    [0, num_decodes) of one token at most, over the step's first decode_tokens rows, on the
    decode tile with decode_splits; the other num_seqs - num_decodes on the general tile of
    max_query_len and max_seq_len (or config) with num_splits. The launch runs with the general
    tile's warps and stages. Arguments otherwise as plan_attention's; the launch takes the whole
    step's query_start, seq_lens and block tables."""
    t, h, d, b, n, hkv = num_tokens, num_heads, head_dim, num_seqs, num_decodes, num_kv_heads
    group = h // hkv
    cfg = config or default_config(max_query_len, group, max_seq_len)
    block_m, block_q = _tile_rows(cfg, group, False)
    decode_m, _ = _tile_rows(DECODE_CONFIG, group, True)
    decode_part, decode_strides = _partials(
        decode_workspace, decode_tokens, h, d, decode_splits, device
    )
    part, part_strides = _partials(workspace, t, h, d, num_splits, device)
    consts = Consts(
        **_shared_consts(group, d, block_size, dtype),
        DECODE_BLOCK_M=decode_m,
        DECODE_TILE_N=DECODE_CONFIG.tile_n,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg.tile_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    merges = []
    if decode_splits > 1:
        merges.append(
            _merge(
                decode_tokens, 0, 0, decode_splits, decode_part, decode_strides, out_strides, h, d
            )
        )
    if num_splits > 1:
        merges.append(
            _merge(
                t - decode_tokens,
                n,
                decode_tokens,
                num_splits,
                part,
                part_strides,
                out_strides,
                h,
                d,
            )
        )
    return AttentionLaunch(
        _mixed_attention_kernel,
        (n * decode_splits + (t // block_q + b - n) * num_splits, hkv),
        (*decode_part, *part),
        (
            scale * LOG2E,
            1.0,
            n,
            decode_splits,
            b - n,
            num_splits,
            *q_strides,
            *out_strides,
            *cache_strides,
            table_stride,
            *decode_strides,
            *part_strides,
        ),
        consts,
        tuple(merges),
    )


def launch_attention(
    launch: AttentionLaunch,
    out: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    seq_lens: Tensor,
    launches: Launches | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Tensor:
    """Run a planned attention: its tensors must have the shapes and strides it was planned with.
    launches: the step's (engine/kernels/launch.py); kv_scales: the layer's fp8 cache's (k_scale,
    v_scale)."""
    launches = launches or Launches()
    launches(
        launch.kernel,
        launch.grid,
        (out, q, k_cache, v_cache, block_tables, query_start, seq_lens, *launch.part),
        launch.args if kv_scales == (1.0, 1.0) else launch.scaled_args(kv_scales),
        launch.consts,
    )
    for merge in launch.merges:
        launches(
            _merge_splits_kernel,
            merge.grid,
            (out, *merge.part, query_start),
            merge.args,
            merge.consts,
        )
    return out


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    seq_lens: Tensor,
    *,
    block_size: int,
    scale: float,
    max_query_len: int,
    max_seq_len: int = 0,
    out: Tensor | None = None,
    num_splits: int = 1,
    workspace: tuple[Tensor, Tensor] | None = None,
    config: AttentionConfig | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Tensor:
    """Causal attention of q [T, H, D] over each sequence's paged KV (see the module docstring);
    returns out [T, H, D].

    max_query_len must be >= every sequence's new-token count; 1 selects the decode grid, else the
    general grid. num_splits > 1 splits the keys of each sequence (decode) or query tile (general)
    across programs (workspace: preallocated partials from workspace_for, else allocated here).
    max_seq_len, the longest sequence's keys (0: not known), picks the append tile (default_config).
    config overrides the tile table (benchmarks). kv_scales: an fp8 cache's (k_scale, v_scale). The
    engine plans a step's launch once (plan_attention) and runs it per layer (launch_attention);
    this checks the arguments, then does both.
    """
    t, h, d = q.shape
    b, hkv = seq_lens.shape[0], k_cache.shape[1]
    assert h % hkv == 0 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and block_tables.stride(1) == 1, (
        "last dims must be contiguous"
    )
    assert query_start.shape[0] == b + 1 and block_tables.shape[0] == b
    if out is None:
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    launch = plan_attention(
        t,
        h,
        d,
        b,
        q.dtype,
        q_strides=q.stride()[:2],
        out_strides=out.stride()[:2],
        cache_strides=k_cache.stride()[:2],
        table_stride=block_tables.stride(0),
        num_kv_heads=hkv,
        block_size=block_size,
        scale=scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        workspace=workspace,
        config=config,
        device=q.device,
    )
    return launch_attention(
        launch, out, q, k_cache, v_cache, block_tables, query_start, seq_lens, kv_scales=kv_scales
    )
