"""The Triton backend's attention for a whole step (engine/attention/triton_backend.py): decodes on
the decode grid and the other sequences on the general grid, each with the KV splits the backend
chooses, launched one after the other or in one launch (MIXED_LAUNCH), eagerly and through the
static buffers of a token bucket's graph, against the float64 reference (Triton's interpreter;
outputs and workspaces start as NaN, unwritten cache slots are NaN)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from engine.attention import AttentionShape, StepBatch, triton_backend
from engine.attention.triton_backend import TritonBackend
from engine.cuda_graphs import graph_buckets
from tests.engine.kernels.test_attention import (
    Batch,
    assert_close,
    make_batch,
    reference,
)

# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 32, 16
SHAPE = AttentionShape(
    HEADS, KV_HEADS, HEAD_DIM, BLOCK, max_blocks_per_seq=80
)  # 1,280 keys: graphs split 4 ways
SCALE = HEAD_DIM**-0.5

# (cached, new) per sequence, decodes first; the KV splits the backend gives the decode and the
# general grid.
STEPS = {
    "both split": ([(700, 1), (300, 1), (20, 1), (1100, 20), (0, 9), (40, 3)], 2, 4),
    "append split": ([(5, 1), (9, 1), (600, 24)], 1, 2),
    "none split": ([(30, 1), (0, 40), (10, 5)], 1, 1),
}


def step_of(batch: Batch, num_decodes: int) -> tuple[StepBatch, Tensor, Tensor]:
    """The StepBatch of batch, and its new tokens' K and V: those already in the cache at their
    slots, so that the backend's KV store leaves the cache as the reference reads it."""
    bs, starts, lens = batch.block_size, batch.query_start.tolist(), batch.seq_lens.tolist()
    tables = [batch.block_tables[i, : -(-n // bs)].tolist() for i, n in enumerate(lens)]
    positions = [p for i, n in enumerate(lens) for p in range(n - (starts[i + 1] - starts[i]), n)]
    seq_of = [i for i in range(len(lens)) for _ in range(starts[i], starts[i + 1])]
    slots = [tables[i][p // bs] * bs + p % bs for i, p in zip(seq_of, positions)]
    step = StepBatch(
        token_ids=[1] * len(slots),
        positions=positions,
        slot_mapping=slots,
        query_start=starts,
        seq_lens=lens,
        block_tables=tables,
        sample_rows=[s - 1 for s in starts[1:]],
        block_size=bs,
        num_decodes=num_decodes,
    )
    return step, batch.k_cache[slots], batch.v_cache[slots]


def decodes(seqs: list[tuple[int, int]]) -> int:
    return sum(1 for _, new in seqs if new == 1)


@pytest.mark.parametrize("name", STEPS)
def test_a_mixed_step_in_either_launch_matches_the_reference(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs, decode_splits, general_splits = STEPS[name]
    batch = make_batch(
        seqs,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        dtype=torch.float32,
        seed=len(name),
    )
    step, k, v = step_of(batch, decodes(seqs))
    outs = []
    for mode in ("sequential", "fused"):
        monkeypatch.setattr(triton_backend, "MIXED_LAUNCH", mode)
        backend = TritonBackend(SHAPE, torch.device("cpu"))
        meta = backend.prepare(step)
        assert (meta.num_splits, meta.general_splits) == (decode_splits, general_splits)
        out = backend.forward(batch.q, k, v, batch.k_cache, batch.v_cache, meta, SCALE)
        assert_close(out, reference(batch, SCALE))
        outs.append(out.clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["sequential", "fused"])
def test_a_mixed_step_through_a_token_buckets_static_buffers(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token bucket is planned for the longest context (4 splits here) and holds the step padded:
    decode slots of no token, padding tokens on the general grid's spare slot (zeros), the general
    merge from row 0 on."""
    monkeypatch.setattr(triton_backend, "MIXED_LAUNCH", mode)
    seqs = STEPS["both split"][0]
    batch = make_batch(
        seqs,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        dtype=torch.float32,
        seed=3,
    )
    step, k, v = step_of(batch, decodes(seqs))
    backend = TritonBackend(SHAPE, torch.device("cpu"))
    buckets = graph_buckets(max_batch=8, max_tokens=64)
    static = backend.graph_metadata(buckets)
    bucket = next(b for b in buckets if not b.decode and b.tokens >= len(step.token_ids))
    assert bucket.tokens == 64 and static.splits[bucket] == 4
    backend.fill_graph_metadata(static, step, bucket)
    meta = backend.graph_view(static, bucket)
    t, pad = len(step.token_ids), bucket.tokens - len(step.token_ids)
    out = backend.forward(
        torch.cat([batch.q, torch.randn(pad, HEADS, HEAD_DIM)]),
        torch.cat([k, torch.zeros(pad, KV_HEADS, HEAD_DIM)]),
        torch.cat([v, torch.zeros(pad, KV_HEADS, HEAD_DIM)]),
        batch.k_cache,
        batch.v_cache,
        meta,
        SCALE,
    )
    assert_close(out[:t], reference(batch, SCALE))
    assert out[t:].abs().max().item() == 0.0, "padding tokens attend to nothing"
