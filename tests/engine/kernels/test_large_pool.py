"""The kernels that index the KV pool at slots whose element offset is past 2**31, as one layer's K
or V of a pool of tens of GB has (Llama-3.1-8B on an H200: ~1.9 GB per layer's K). Triton
computes offsets in int32 unless a factor is int64: an int32 product wraps there, to an address
before the pool (a crash) or inside it (a wrong key).

The caches are allocated with torch.empty and only the used slots are ever touched, so a pool of 4
GiB per cache costs the test a few pages. Under TRITON_INTERPRET the interpreter computes the
offsets with the kernel's own integer types, so a wrap shows here as on the GPU (where the same
tests run on device memory).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention import paged_attention
from engine.kernels.store_kv import store_kv
from tests.engine.kernels.test_attention import Batch, assert_close, make_batch, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 16, 16
STRIDE_SLOT = KV_HEADS * HEAD_DIM
FIRST_FAR_SLOT = (
    2**31 // STRIDE_SLOT // BLOCK_SIZE + 1
) * BLOCK_SIZE  # the first block whose offset is past 2**31
NUM_SLOTS = FIRST_FAR_SLOT + 64 * BLOCK_SIZE


def far_caches() -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [NUM_SLOTS, KV_HEADS, HEAD_DIM] bf16 of more than 2**31 elements each,
    untouched."""
    shape = (NUM_SLOTS, KV_HEADS, HEAD_DIM)
    return (
        torch.empty(shape, dtype=torch.bfloat16, device=DEVICE),
        torch.empty(shape, dtype=torch.bfloat16, device=DEVICE),
    )


def test_store_kv_writes_slots_past_two_to_the_31_elements() -> None:
    k_cache, v_cache = far_caches()
    assert k_cache.numel() > 2**31
    gen = torch.Generator().manual_seed(0)
    k, v = (
        torch.randn(4, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE, torch.bfloat16)
        for _ in range(2)
    )
    slots = torch.tensor(
        [3, FIRST_FAR_SLOT - 1, FIRST_FAR_SLOT, NUM_SLOTS - 1], dtype=torch.int64, device=DEVICE
    )
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)


@pytest.mark.parametrize(
    ("seqs", "num_splits"),
    [([(40, 1), (7, 1)], 4), ([(29, 12), (0, 21)], 1)],
    ids=["decode-split", "append-prefill"],
)
def test_attention_reads_blocks_past_two_to_the_31_elements(
    seqs: list[tuple[int, int]], num_splits: int
) -> None:
    """The batch's blocks moved to the far end of a large pool give the same output as in a small
    one."""
    small = make_batch(
        seqs,
        heads=4,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        dtype=torch.bfloat16,
        seed=3,
    )
    k_cache, v_cache = far_caches()
    k_cache[FIRST_FAR_SLOT : FIRST_FAR_SLOT + small.k_cache.shape[0]] = small.k_cache
    v_cache[FIRST_FAR_SLOT : FIRST_FAR_SLOT + small.v_cache.shape[0]] = small.v_cache
    far = Batch(
        small.q,
        k_cache,
        v_cache,
        small.block_tables + FIRST_FAR_SLOT // BLOCK_SIZE,
        small.query_start,
        small.seq_lens,
        BLOCK_SIZE,
        small.max_query_len,
    )
    scale = HEAD_DIM**-0.5
    out = paged_attention(
        far.q,
        far.k_cache,
        far.v_cache,
        far.block_tables,
        far.query_start,
        far.seq_lens,
        block_size=BLOCK_SIZE,
        scale=scale,
        max_query_len=far.max_query_len,
        num_splits=num_splits,
    )
    assert_close(out, reference(small, scale))
