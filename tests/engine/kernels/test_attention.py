"""paged_attention against a float64 reference that gathers each sequence's keys through its block
table.

Small shapes run everywhere (on the CPU under TRITON_INTERPRET=1); the Llama-3.1-8B shapes and the
CUDA-graph replay are marked gpu. Every cache slot that holds no valid key is NaN and every unused
block-table entry points at an all-NaN block, so a read past a sequence's keys shows up as NaN in
the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from engine.kernels.attention import (
    APPEND_CONFIG,
    DECODE_CONFIG,
    PREFILL_CONFIGS,
    AttentionConfig,
    choose_append_splits,
    choose_num_splits,
    default_config,
    general_programs,
    launch_attention,
    paged_attention,
    plan_mixed_attention,
    workspace_for,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD = (0, 0)  # a CUDA-graph padding row: seq_len 0, one query token
SMALL = AttentionConfig(
    block_m=16, tile_n=16, num_warps=4, num_stages=2
)  # many tiles even at test sizes
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Over a minute of Triton's interpreter on 2 cores: started first (tests/conftest.py).
RUN_FIRST = True


# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


@dataclass
class Batch:
    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    query_start: Tensor
    seq_lens: Tensor
    block_size: int
    max_query_len: int


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    strided_q: bool = False,
    device: str = DEVICE,
) -> Batch:
    """seqs: (cached, new) tokens per sequence, or PAD. Blocks are handed out in a random order;
    block 0 is NaN."""
    gen = torch.Generator().manual_seed(seed)  # block order, on the host
    data = torch.Generator(device).manual_seed(
        seed
    )  # q, K, V, made where they are used (GPU sizes are large)
    new = [1 if s == PAD else s[1] for s in seqs]
    kv_lens = [c + n for c, n in seqs]
    used = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = 1 + sum(used) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(used) + 1, dtype=torch.int32)
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, (n_blocks, kv_len) in enumerate(zip(used, kv_lens)):
        tables[b, :n_blocks] = torch.tensor(order[:n_blocks], dtype=torch.int32)
        order = order[n_blocks:]
        pos = torch.arange(kv_len)
        valid[tables[b, pos // block_size].long() * block_size + pos % block_size] = True
    invalid = ~valid.to(device)[:, None, None]
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=data, device=device, dtype=dtype).masked_fill(
        invalid, float("nan")
    )
    v_cache = torch.randn(shape, generator=data, device=device, dtype=dtype).masked_fill(
        invalid, float("nan")
    )
    t = sum(new)
    if strided_q:  # q as the leading slice of a fused qkv projection output
        q = torch.randn(
            t, (heads + 2 * kv_heads) * head_dim, generator=data, device=device, dtype=dtype
        )
        q = q[:, : heads * head_dim].view(t, heads, head_dim)
    else:
        q = torch.randn(t, heads, head_dim, generator=data, device=device, dtype=dtype)
    query_start = torch.tensor(
        [0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    return Batch(
        q,
        k_cache,
        v_cache,
        tables.to(device),
        query_start,
        torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_size,
        max(new),
    )


def reference(batch: Batch, scale: float) -> Tensor:
    """float64 causal attention per sequence over the keys gathered through its block table; zeros
    for padding."""
    q = batch.q.double()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // batch.k_cache.shape[1]
    bs = batch.block_size
    for b, kv_len in enumerate(batch.seq_lens.tolist()):
        start, end = batch.query_start[b].item(), batch.query_start[b + 1].item()
        if kv_len == 0:
            continue
        pos = torch.arange(kv_len, device=q.device)
        slots = batch.block_tables[b, pos // bs].long() * bs + pos % bs
        k = batch.k_cache[slots].double().repeat_interleave(group, dim=1)
        v = batch.v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale
        q_pos = kv_len - (end - start) + torch.arange(end - start, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def assert_close(out: Tensor, ref: Tensor) -> None:
    assert not out.isnan().any(), "an output element was not written, or a masked key was read"
    err = out.double() - ref
    rel_tol, abs_tol = (1e-3, 1e-3) if out.dtype == torch.float32 else (2e-2, 6e-2)
    rel = (err.norm() / ref.norm()).item()
    assert rel < rel_tol, f"relative error {rel:.2e}"
    assert err.abs().max().item() < abs_tol, f"max abs error {err.abs().max().item():.2e}"


def run(batch: Batch, *, out: Tensor | None = None, **kw: object) -> Tensor:
    scale = batch.q.shape[2] ** -0.5
    if out is None:
        out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=batch.q.device)
    result = paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.query_start,
        batch.seq_lens,
        block_size=batch.block_size,
        scale=scale,
        max_query_len=batch.max_query_len,
        out=out,
        **kw,
    )
    assert result is out
    assert_close(out, reference(batch, scale))
    return out


DECODE = [(37, 1), (5, 1), (0, 1), (64, 1), (100, 1)]
PREFILL = [(0, 40), (0, 7), (0, 1), (0, 19)]
APPEND = [(29, 12), (64, 20), (3, 1), (16, 33)]
MIXED = [(50, 1), (0, 23), (31, 9), PAD, (7, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seqs", [DECODE, PREFILL, APPEND, MIXED], ids=["decode", "prefill", "append", "mixed"]
)
def test_batch_kinds(seqs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    batch = make_batch(
        seqs, heads=4, kv_heads=2, head_dim=32, block_size=4, dtype=dtype, seed=len(seqs)
    )
    run(batch, config=SMALL)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (2, 2, 16, 16),
        (4, 1, 16, 4),
        (6, 2, 24, 16),
        (8, 2, 8, 4),
        (7, 1, 64, 8),
        (4, 4, 128, 32),
    ],
)
def test_group_sizes_and_head_dims(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """G = 1, 4, 3, 4, 7, 1; head dims below 16 and not powers of two are padded and masked."""
    batch = make_batch(
        MIXED,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        seed=heads * head_dim,
        strided_q=True,
    )
    run(batch, config=SMALL)


def test_default_config_long_prefill_crosses_query_tiles() -> None:
    """The default table's 128-row tile: a 300-token append spans several tiles, one beside a decode
    row."""
    batch = make_batch(
        [(70, 300), (12, 1)],
        heads=2,
        kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.bfloat16,
        seed=7,
    )
    run(batch)


def test_default_config_tiles_by_step_kind() -> None:
    """Decode, prefill and append tiles: an append of more than 64 rows over a cached prefix of 4x
    its new tokens takes the append tile (64 rows, 128-key steps); one without its keys known, or
    over a short prefix, a prefill tile."""
    assert default_config(1, 4, 4096) == DECODE_CONFIG
    assert default_config(256, 4) == default_config(256, 4, 300) == PREFILL_CONFIGS[-1]
    assert default_config(256, 4, 256 + 4096) == default_config(17, 4, 1024) == APPEND_CONFIG
    assert default_config(16, 4, 4096) == PREFILL_CONFIGS[2], (
        "64 rows: the prefill table's 64-row tile"
    )


def test_append_over_a_long_prefix_with_the_append_tile() -> None:
    """The append tile over 600 cached keys: 40 new tokens x 2 query heads per KV head = 80 rows,
    two query tiles, five 128-key steps."""
    batch = make_batch(
        [(600, 40), (5, 1), (130, 33)],
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.bfloat16,
        seed=11,
    )
    assert default_config(batch.max_query_len, 2, max(batch.seq_lens.tolist())) == APPEND_CONFIG
    run(batch, max_seq_len=max(batch.seq_lens.tolist()))


def test_padding_rows_get_zeros() -> None:
    batch = make_batch(
        [(20, 1), PAD, PAD],
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        seed=3,
    )
    out = run(batch, config=SMALL)
    assert out[1:].abs().max().item() == 0.0
    out = run(batch, num_splits=4, config=SMALL)
    assert out[1:].abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_split_kv_matches_unsplit(num_splits: int, dtype: torch.dtype) -> None:
    """16 splits exceed some sequences' tile count: those splits are empty and the merge must skip
    them."""
    batch = make_batch(
        DECODE + [PAD], heads=6, kv_heads=2, head_dim=24, block_size=4, dtype=dtype, seed=11
    )
    whole = run(batch, config=SMALL)
    split = run(batch, num_splits=num_splits, config=SMALL)
    # bf16 on a GPU: P is rounded against each split's own running max, so the two may differ by
    # bf16 rounding.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(split, whole, rtol=tol, atol=tol)


def test_split_kv_with_preallocated_workspace_and_strided_out() -> None:
    """The workspace may hold more rows than the step (graphs size it for the largest batch); stale
    contents, here NaN, must not leak into the result; out may be a strided view and nothing outside
    it is touched."""
    batch = make_batch(
        DECODE,
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
        seed=5,
        strided_q=True,
    )
    part, lse = workspace_for(len(DECODE) + 3, 4, 16, 4, DEVICE)
    part.fill_(float("nan"))
    lse.fill_(float("nan"))
    backing = torch.full((len(DECODE), 4, 40), float("nan"), device=DEVICE)
    run(batch, out=backing[:, :, 8:24], num_splits=4, workspace=(part, lse), config=SMALL)
    assert backing[:, :, :8].isnan().all() and backing[:, :, 24:].isnan().all()


def test_allocates_out_when_not_given() -> None:
    batch = make_batch(
        APPEND, heads=2, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32, seed=9
    )
    scale = 0.25
    out = paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.query_start,
        batch.seq_lens,
        block_size=4,
        scale=scale,
        max_query_len=batch.max_query_len,
    )
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert_close(out, reference(batch, scale))


def test_choose_num_splits() -> None:
    for batch_size in (1, 2, 8, 32, 64, 256):
        for ctx in (16, 255, 1024, 4096, 32768):
            n = choose_num_splits(batch_size, 8, ctx)
            assert 1 <= n <= 16 and n & (n - 1) == 0, "a power of two within max_splits"
            assert n == 1 or ctx // n >= 256, "no split shorter than 256 keys"
    assert choose_num_splits(1, 8, 4096) == 16, "one sequence alone would use 8 of 132 SMs"
    assert choose_num_splits(256, 8, 16384) == 1, "2048 programs already fill the GPU"
    assert choose_num_splits(1, 8, 100) == 1, "too short to split"
    assert choose_num_splits(1, 8, 1 << 20, max_splits=4) == 4


# ---- split-KV on the general grid, and both grids in one launch ----------------------------------

# Cached prefixes of 0, under one 4-token block, under one 16-key tile, of exactly one tile, across
# tile and block boundaries, of four tiles with the new tokens (one for each of 4 splits); a
# one-token sequence and a padding row on the general grid too.
GENERAL = [(0, 9), (1, 3), (3, 1), (5, 17), PAD, (16, 2), (37, 5), (61, 3)]


def nan_workspace(tokens: int, heads: int, head_dim: int, splits: int) -> tuple[Tensor, Tensor]:
    """A workspace with more rows than the step, holding NaN: a partial the merge must not read
    shows up."""
    part, lse = workspace_for(tokens + 5, heads, head_dim, splits, DEVICE)
    return part.fill_(float("nan")), lse.fill_(float("nan"))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "num_splits"),
    [(2, 2, 2), (2, 2, 4), (4, 2, 1), (4, 2, 4), (8, 2, 2), (8, 1, 4)],
    ids=["G1-2", "G1-4", "G2-1", "G2-4", "G4-2", "G8-4"],
)
def test_general_grid_splits_match_the_reference(
    heads: int, kv_heads: int, num_splits: int
) -> None:
    """Split counts over GQA ratios; splits past a short sequence's keys (most of them, at 4 splits
    of a 16-key tile) are empty, and a split may end before a row's first key (causal)."""
    batch = make_batch(
        GENERAL,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        seed=heads + num_splits,
    )
    run(
        batch,
        num_splits=num_splits,
        workspace=nan_workspace(len(batch.q), heads, 16, num_splits),
        config=SMALL,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_general_grid_splits_with_the_append_tile(dtype: torch.dtype) -> None:
    """The append tile (64 rows, 128-key steps) split 4 ways: 170 keys make two key tiles, so two
    splits are empty; 600 keys make five, split 2, 2, 1 and 0 (each split takes cdiv(tiles,
    splits))."""
    batch = make_batch(
        [(130, 40), (5, 1), (600, 33), PAD],
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=dtype,
        seed=13,
    )
    max_seq_len = max(batch.seq_lens.tolist())
    assert default_config(batch.max_query_len, 2, max_seq_len) == APPEND_CONFIG
    run(
        batch,
        max_seq_len=max_seq_len,
        num_splits=4,
        workspace=nan_workspace(len(batch.q), 4, 16, 4),
    )


def test_choose_append_splits() -> None:
    group, hkv = 4, 8  # Llama-3.1-8B
    programs = general_programs(256, group, hkv, APPEND_CONFIG)
    assert programs == 16 * 8, "256 tokens in 16-token tiles, for each KV head"
    assert choose_append_splits(programs, 256, 256 + 4096) == 2, (
        "136 programs for 132 SMs: toward 2 per SM"
    )
    big = AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=2)
    assert choose_append_splits(general_programs(256, group, hkv, big), 256, 256 + 16384) == 4
    assert choose_append_splits(1, 256, 1 << 20) == 4, "at most APPEND_MAX_SPLITS"
    assert choose_append_splits(programs, 256, 1000) == 1, (
        "a fresh prompt (under 4 keys per query) does not split"
    )
    assert choose_append_splits(8, 2, 300) == 1, "300 keys: too short to split"
    for new in (2, 17, 64, 256, 2048):
        for ctx in (new, 4 * new, 1000, 4096, 100_000):
            n = choose_append_splits(
                general_programs(new, group, hkv, default_config(new, group, ctx)), new, ctx
            )
            assert n in (1, 2, 4) and (n == 1 or ctx // n >= 256), (
                "a power of two, no split under 256 keys"
            )
    assert choose_append_splits(programs, 256, 1 << 20, num_sms=16) == 1, "128 programs fill 16 SMs"


def run_mixed(
    batch: Batch,
    num_decodes: int,
    *,
    decode_splits: int = 1,
    num_splits: int = 1,
    decode_tokens: int | None = None,
    **kw: object,
) -> Tensor:
    """Attention of batch, whose first num_decodes sequences add one token each, in one launch of
    both grids; checked against the reference. decode_tokens: what the plan is told of the
    decodes' rows (a captured step's plan: 0)."""
    q, scale = batch.q, batch.q.shape[2] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    t, h, d = q.shape
    launch = plan_mixed_attention(
        t,
        h,
        d,
        len(batch.seq_lens),
        q.dtype,
        q_strides=q.stride()[:2],
        out_strides=out.stride()[:2],
        cache_strides=batch.k_cache.stride()[:2],
        table_stride=batch.block_tables.stride(0),
        num_kv_heads=batch.k_cache.shape[1],
        block_size=batch.block_size,
        scale=scale,
        num_decodes=num_decodes,
        decode_tokens=num_decodes if decode_tokens is None else decode_tokens,
        decode_splits=decode_splits,
        max_query_len=batch.max_query_len,
        num_splits=num_splits,
        device=q.device,
        decode_workspace=nan_workspace(num_decodes, h, d, decode_splits)
        if decode_splits > 1
        else None,
        workspace=nan_workspace(t, h, d, num_splits) if num_splits > 1 else None,
        **kw,
    )
    launch_attention(
        launch,
        out,
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.query_start,
        batch.seq_lens,
    )
    assert_close(out, reference(batch, scale))
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "decode_splits", "num_splits"),
    [(4, 2, 1, 1), (8, 1, 4, 1), (4, 2, 1, 2), (8, 1, 2, 4)],
)
def test_both_grids_in_one_launch(
    heads: int, kv_heads: int, decode_splits: int, num_splits: int
) -> None:
    """Decodes (one a padding row) on the decode role with their splits, the rest on the general
    role with its own tile and splits, in one launch: the general role's sequences start at row 4
    of q and slot 4."""
    batch = make_batch(
        [(300, 1), (5, 1), PAD, (64, 1)] + GENERAL,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        seed=heads * 10 + decode_splits * num_splits,
    )
    run_mixed(batch, 4, decode_splits=decode_splits, num_splits=num_splits, config=SMALL)


def test_the_general_merge_from_row_0_leaves_the_decodes_rows() -> None:
    """As a token bucket's graph plans it, the general grid's merge covers every row and skips, on
    the device, those before its first sequence's (the decodes', which it never wrote partials
    for)."""
    batch = make_batch(
        [(300, 1), (5, 1), PAD, (64, 1)] + GENERAL,
        heads=4,
        kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        seed=19,
    )
    run_mixed(batch, 4, num_splits=2, decode_tokens=0, config=SMALL)


def test_both_grids_in_one_launch_with_the_append_tile() -> None:
    batch = make_batch(
        [(40, 1), (0, 1), (700, 60), (20, 3)],
        heads=8,
        kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.bfloat16,
        seed=17,
    )
    max_seq_len = max(batch.seq_lens.tolist()[2:])
    assert default_config(batch.max_query_len, 4, max_seq_len) == APPEND_CONFIG
    run_mixed(batch, 2, decode_splits=2, num_splits=2, max_seq_len=max_seq_len)


# ---- GPU: Llama-3.1-8B shapes --------------------------------------------------------------------

LLAMA = dict(heads=32, kv_heads=8, head_dim=128, block_size=16)


def random_decode(batch_size: int, max_ctx: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(c), 1) for c in torch.randint(1, max_ctx, (batch_size,), generator=gen)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch_size", [1, 8, 64, 256])
def test_gpu_decode_llama(batch_size: int, dtype: torch.dtype) -> None:
    batch = make_batch(
        random_decode(batch_size, 4096, batch_size), dtype=dtype, seed=batch_size, **LLAMA
    )
    whole = run(batch)
    for splits in {2, 8, choose_num_splits(batch_size, 8, 4096)}:
        split = run(batch, num_splits=splits)
        torch.testing.assert_close(split, whole, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 2048)],
        [(3000, 256)],
        [(0, 1000), (700, 300), (2500, 1), (4000, 1), PAD, (0, 77)],
    ],
    ids=["prefill", "append", "mixed"],
)
def test_gpu_prefill_llama(seqs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    run(make_batch(seqs, dtype=dtype, seed=len(seqs), **LLAMA))


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_cuda_graph_replay() -> None:
    """Capture split-KV decode once; after rewriting seq_lens, block tables, q and the cache in
    place, a replay matches the reference for the new contents (the grid depends on no seq_lens
    value)."""
    splits, batch_size = 8, 16
    first = make_batch(random_decode(batch_size, 4096, 1), dtype=torch.bfloat16, seed=1, **LLAMA)
    second = make_batch(random_decode(batch_size, 4096, 2), dtype=torch.bfloat16, seed=2, **LLAMA)
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    slots = max(first.k_cache.shape[0], second.k_cache.shape[0])
    static = Batch(
        first.q.clone(),
        torch.zeros(slots, 8, 128, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(slots, 8, 128, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(batch_size, width, dtype=torch.int32, device="cuda"),
        first.query_start.clone(),
        first.seq_lens.clone(),
        16,
        1,
    )
    out = torch.empty_like(static.q)
    workspace = workspace_for(batch_size, 32, 128, splits, "cuda")

    def load(src: Batch) -> None:
        static.q.copy_(src.q)
        static.seq_lens.copy_(src.seq_lens)
        static.block_tables.zero_()
        static.block_tables[:, : src.block_tables.shape[1]].copy_(src.block_tables)
        for cache, new in ((static.k_cache, src.k_cache), (static.v_cache, src.v_cache)):
            cache.fill_(float("nan"))
            cache[: new.shape[0]].copy_(new)

    def step() -> None:
        paged_attention(
            static.q,
            static.k_cache,
            static.v_cache,
            static.block_tables,
            static.query_start,
            static.seq_lens,
            block_size=16,
            scale=128**-0.5,
            max_query_len=1,
            out=out,
            num_splits=splits,
            workspace=workspace,
        )

    load(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for src in (first, second):
        load(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(static, 128**-0.5))
