"""The second KV tier: evicted prefix blocks kept behind the pool and loaded back
(engine/kv_tier.py, BlockManager with a TierIndex), and retention hints at eviction. The KV is
modelled two ways: by the prefix each block's KV was computed for (what a prompt is served must be
exactly its own prefix), and with real tensors through TierStore (what comes back is the bytes
that went out, never a reused block's)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine.block_manager import BlockManager
from engine.kv_tier import KVCopy, TierIndex, TierStore, tier_capacity

BS = 4


def turn(bm: BlockManager, seq_id: str, tokens: list[int]) -> int:
    """Allocate, compute and cache a prompt, then end it: what a finished turn leaves behind.
    Returns its cached tokens."""
    cached = bm.allocate(seq_id, tokens)
    assert cached is not None
    bm.cache_blocks(seq_id, tokens, len(tokens))
    bm.free(seq_id)
    return cached


def run_copies(bm: BlockManager) -> list[KVCopy]:
    copies = bm.take_copies()
    bm.copies_done(copies)
    return copies


def test_an_evicted_prefix_is_stored_then_loaded_back_as_cached() -> None:
    bm = BlockManager(4, BS, tier=TierIndex(8))
    a = list(range(1, 13))  # 3 full blocks
    turn(bm, "a", a)
    assert not bm.take_copies()  # nothing evicted yet
    turn(bm, "b", list(range(50, 66)))  # 4 blocks: a's three are evicted to the tier
    stored = run_copies(bm)
    assert [c.store for c in stored] == [True, True, True]
    assert bm.tier.num_blocks == 3 and bm.tier.stats.stored == 3
    cached = bm.allocate("a2", a + [99])
    assert cached == 12  # all three blocks, from the tier
    loads = bm.take_copies()
    table = bm.block_table("a2")
    loads_only = [c for c in loads if not c.store]
    assert [c.block_id for c in loads_only] == table[:3]
    bm.copies_done(loads)
    assert bm.tier.stats.loaded == 3
    bm.check()


def test_a_store_is_invisible_until_its_copy_completed() -> None:
    bm = BlockManager(3, BS, tier=TierIndex(8))
    a = list(range(1, 9))
    turn(bm, "a", a)
    turn(bm, "b", list(range(50, 62)))  # evicts a's two blocks
    pending = bm.take_copies()
    assert len(pending) == 2
    assert bm.peek_cached_tokens(a + [1]) == 0  # recorded, not copied: not found
    bm.copies_done(pending)
    assert bm.peek_cached_tokens(a + [1]) == 8


def test_a_pinned_entry_is_not_dropped_by_the_evictions_of_its_own_allocation() -> None:
    # The tier has room for two blocks: loading a's two evicts b's two pool blocks, whose stores
    # must not take the slots a's loads read.
    bm = BlockManager(4, BS, tier=TierIndex(2))
    a, b = list(range(1, 9)), list(range(50, 58))
    turn(bm, "a", a)
    turn(bm, "b", b)
    turn(bm, "c", list(range(100, 116)))  # evicts all four; the tier keeps two of them
    run_copies(bm)
    found = bm.peek_cached_tokens(a + [0]) or bm.peek_cached_tokens(b + [0])
    assert found == 8
    prompt = (a if bm.peek_cached_tokens(a + [0]) else b) + [0]
    assert bm.allocate("again", prompt) == 8
    copies = bm.take_copies()
    loads = [c for c in copies if not c.store]
    stores = [c for c in copies if c.store]
    assert len(loads) == 2
    assert not {c.slot for c in loads} & {c.slot for c in stores}
    bm.copies_done(copies)
    bm.check()


def test_tier_lru_drops_the_least_recently_used_and_counts_it() -> None:
    tier = TierIndex(2)
    for h in (1, 2):
        tier.offer(h, None, (h,), block_id=h)
    tier.copies_done(tier.take_copies())
    assert tier.find(1, None, (1,))  # a find does not refresh; a load does
    tier.pin(1)
    tier.load(1, block_id=7)
    tier.copies_done(tier.take_copies())
    tier.offer(3, None, (3,), block_id=3)  # drops 2, the least recently used
    tier.copies_done(tier.take_copies())
    assert tier.find(1, None, (1,)) and tier.find(3, None, (3,)) and not tier.find(2, None, (2,))
    assert tier.stats.dropped == 1
    tier.check()


def test_offering_a_block_the_tier_holds_copies_nothing() -> None:
    tier = TierIndex(4)
    tier.offer(5, None, (1, 2), block_id=0)
    tier.copies_done(tier.take_copies())
    tier.offer(5, None, (1, 2), block_id=3)
    assert tier.take_copies() == []


def test_the_same_hash_for_other_tokens_or_another_parent_is_never_found() -> None:
    tier = TierIndex(4)
    tier.offer(5, 9, (1, 2), block_id=0)
    tier.copies_done(tier.take_copies())
    assert tier.find(5, 9, (1, 2))
    assert not tier.find(5, 9, (1, 3)) and not tier.find(5, 8, (1, 2))


def test_with_every_slot_pinned_an_eviction_is_dropped_not_stored() -> None:
    tier = TierIndex(1)
    tier.offer(1, None, (1,), block_id=0)
    tier.copies_done(tier.take_copies())
    tier.pin(1)
    tier.load(1, block_id=2)
    tier.offer(2, None, (2,), block_id=1)
    assert [c.store for c in tier.take_copies()] == [False]
    assert tier.stats.dropped == 1


def test_tier_capacity_counts_whole_blocks() -> None:
    assert tier_capacity(1.0, 1 << 20) == 1024
    assert tier_capacity(0.0001, 1 << 20) == 0


# ---- bytes: TierStore with a real pool ----------------------------------------------------------


def pool_tensor(num_blocks: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
    return torch.zeros(2, 2, num_blocks, BS, 2, 3, dtype=dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def fill(pool: torch.Tensor, block_id: int, value: float) -> None:
    pool[:, :, block_id] = (
        value
        + torch.arange(pool[:, :, block_id].numel()).view(pool[:, :, block_id].shape).to(pool.dtype)
        / 1024
    )


def test_a_reused_pool_block_is_never_read_back_stale(tmp_path) -> None:
    pool = pool_tensor(3)
    store = TierStore(pool, capacity=4, folder=tmp_path)
    assert not list(tmp_path.iterdir())  # the file is unlinked once mapped
    bm = BlockManager(3, BS, tier=TierIndex(store.capacity))
    a = list(range(1, 9))
    bm.allocate("a", a)
    for i, block in enumerate(bm.block_table("a")):
        fill(pool, block, 10 + i)
    expected = [pool[:, :, b].clone() for b in bm.block_table("a")]
    bm.cache_blocks("a", a, len(a))
    bm.free("a")
    b = list(range(50, 62))
    bm.allocate("b", b)  # takes a's blocks: their stores are recorded
    store.run(copies := bm.take_copies())
    bm.copies_done(copies)
    for block in bm.block_table("b"):  # b's step overwrites every block
        fill(pool, block, -5)
    bm.cache_blocks("b", b, len(b))
    bm.free("b")
    assert bm.allocate("a2", a + [0]) == 8
    store.run(copies := bm.take_copies())  # b's blocks out to the tier, a's back in
    bm.copies_done(copies)
    for got, want in zip(bm.block_table("a2")[:2], expected):
        assert torch.equal(pool[:, :, got], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # fp8: --kv-cache-dtype
def test_the_tier_survives_many_rounds_of_overwrite_and_reload(tmp_path, dtype) -> None:
    """Random traffic over a pool smaller than its working set: whatever a prompt is served from
    the pool or the tier is exactly the KV computed for its own prefix."""
    rng = random.Random(1)
    pool = pool_tensor(6, dtype)
    store = TierStore(pool, capacity=10, folder=tmp_path)
    bm = BlockManager(6, BS, tier=TierIndex(store.capacity))
    convs = [[rng.randrange(1, 40) for _ in range(8)] for _ in range(5)]
    for step in range(200):
        c = rng.randrange(len(convs))
        tokens = convs[c] + [rng.randrange(1, 40)]
        cached = bm.allocate(f"s{step}", tokens)
        if cached is None:
            continue
        store.run(copies := bm.take_copies())
        bm.copies_done(copies)
        table = bm.block_table(f"s{step}")
        for i in range(cached // BS):  # served: the KV of this prompt's own prefix
            assert same_bytes(pool[:, :, table[i]], value_of(tokens[: (i + 1) * BS], pool))
        for i in range(cached // BS, len(table)):  # the step writes the rest
            pool[:, :, table[i]] = value_of(tokens[: (i + 1) * BS], pool)
        bm.cache_blocks(f"s{step}", tokens, len(tokens))
        bm.free(f"s{step}")
        # The conversation grows by its turn; a long one ends and a new one takes its place.
        convs[c] = tokens if len(tokens) < 20 else [rng.randrange(1, 40) for _ in range(8)]
        bm.check()
    loaded = bm.tier.stats.loaded * BS
    assert loaded > 50 and bm.tier.stats.dropped > 0  # both paths ran


def value_of(prefix: list[int], pool: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(tuple(prefix)) % (1 << 31))
    return torch.randn(pool[:, :, 0].shape, generator=g).to(pool.dtype)


def test_copies_of_a_pool_on_the_cpu_land_in_the_file(tmp_path) -> None:
    pool = pool_tensor(2)
    fill(pool, 1, 3)
    store = TierStore(pool, capacity=2, folder=tmp_path)
    assert store.run([KVCopy(True, 1, 1)]) is None
    assert torch.equal(store.data[1], pool[:, :, 1])
    pool[:, :, 0] = 0
    store.run([KVCopy(False, 0, 1)])
    assert torch.equal(pool[:, :, 0], pool[:, :, 1])


# ---- retention ----------------------------------------------------------------------------------


def test_retained_blocks_are_evicted_after_every_plain_one() -> None:
    bm = BlockManager(4, BS, retention_share=0.5)
    kept, plain = list(range(1, 9)), list(range(20, 28))
    bm.allocate("kept", kept)
    bm.cache_blocks("kept", kept, 8)
    bm.free("kept", retain_s=60)
    turn(bm, "plain", plain)
    assert bm.num_retained == 2
    turn(bm, "new", list(range(40, 52)))  # needs three: both plain ones go, then one retained
    assert bm.peek_cached_tokens(plain + [0]) == 0
    assert bm.num_retained == 1
    bm.check()


def test_retention_holds_at_most_its_share_of_the_pool() -> None:
    bm = BlockManager(8, BS, retention_share=0.25)
    bm.allocate("a", list(range(1, 17)))
    bm.cache_blocks("a", list(range(1, 17)), 16)
    bm.free("a", retain_s=60)
    assert bm.num_retained == 2  # a quarter of 8; the other two blocks go to the plain LRU
    bm.check()


def test_expired_retention_is_plain_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    bm = BlockManager(4, BS, retention_share=1.0)
    old = list(range(1, 9))
    bm.allocate("old", old)
    bm.cache_blocks("old", old, 8)
    bm.free("old", retain_s=10)
    turn(bm, "plain", list(range(20, 28)))
    now[0] += 11  # old's retention is over: it goes first, before the plain blocks
    turn(bm, "new", list(range(40, 48)))
    assert bm.peek_cached_tokens(old + [0]) == 0
    assert bm.peek_cached_tokens(list(range(20, 28)) + [0]) == 8
    assert bm.num_retained == 0
    bm.check()


def test_a_retained_block_a_prompt_matches_is_pinned_again_and_released_with_it() -> None:
    bm = BlockManager(4, BS, retention_share=1.0)
    a = list(range(1, 9))
    bm.allocate("a", a)
    bm.cache_blocks("a", a, 8)
    bm.free("a", retain_s=60)
    assert bm.allocate("a2", a + [0]) == 8
    assert bm.num_retained == 0
    bm.free("a2")
    assert bm.num_retained == 0 and bm.num_free_blocks == 4
    bm.check()


@pytest.mark.gpu
def test_on_a_gpu_the_tier_is_pinned_host_memory_copied_on_its_own_stream() -> None:
    """The GPU path: stores and loads queued on the tier's stream behind the current one, the
    current stream waiting for their event; what comes back is what went out."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pool = torch.randn(2, 2, 6, BS, 2, 8, device="cuda").to(torch.bfloat16)
    store = TierStore(pool, capacity=4)
    assert store.data.is_pinned() and store.stream is not None
    saved = pool[:, :, [1, 3]].clone()
    done = store.run([KVCopy(True, 1, 0), KVCopy(True, 3, 2)])
    pool[:, :, [1, 3]] = 0  # on the current stream, which waits for the stores
    store.run([KVCopy(False, 4, 0), KVCopy(False, 5, 2)]).synchronize()
    assert done.query()
    assert torch.equal(pool[:, :, 4], saved[:, :, 0]) and torch.equal(pool[:, :, 5], saved[:, :, 1])
    assert torch.equal(store.data[0], saved[:, :, 0].cpu())


def test_a_colliding_offer_never_takes_the_slot_of_an_entry_a_copy_uses() -> None:
    tier = TierIndex(4)
    tier.offer(5, None, (1, 2), block_id=0)
    tier.copies_done(tier.take_copies())
    tier.pin(5)
    tier.load(5, block_id=3)
    tier.offer(5, None, (7, 7), block_id=1)  # the same hash for other tokens, while a load reads 5
    assert [c.store for c in tier.take_copies()] == [False] and tier.stats.dropped == 1
    assert tier.find(5, None, (1, 2))


def test_a_prompt_whose_blocks_the_tier_is_storing_waits_for_the_copy_instead_of_recomputing() -> (
    None
):
    # One schedule: b's allocation evicts a's blocks (their stores recorded, not yet run), then a's
    # next turn comes: it waits for the copies, then finds its whole prefix.
    bm = BlockManager(3, BS, tier=TierIndex(8))
    a = list(range(1, 9))
    turn(bm, "a", a)
    turn(bm, "b", list(range(50, 62)))  # evicts a's two blocks
    assert bm.allocate("a2", a + [0]) is None and bm.awaiting_tier
    bm.copies_done(bm.take_copies())  # the decode worker runs them after scheduling
    assert not bm.awaiting_tier
    assert bm.allocate("a2", a + [0]) == 8
    bm.check()
