"""BlockManager: accounting, prefix hits, collision safety, LRU eviction, and a randomized invariant
check."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import engine.block_manager as bm_module
from engine.block_manager import BlockManager
from engine.prefix_hash import block_hashes, chain_hash


def check_invariants(bm: BlockManager) -> None:
    """Every block in exactly one state; ref counts match the live tables; the hash index is
    consistent."""
    holders = Counter(b for seq in bm._seqs.values() for b in seq.table)
    for seq in bm._seqs.values():
        assert len(set(seq.table)) == len(seq.table), "a block twice in one table"
    free, evictable = list(bm._free), list(bm._evictable)
    assert len(set(free)) == len(free)
    referenced = {b.block_id for b in bm._blocks if b.ref_count > 0}
    assert (
        not set(free) & set(evictable)
        and not set(free) & referenced
        and not set(evictable) & referenced
    )
    assert len(free) + len(evictable) + len(referenced) == bm.num_blocks
    for block in bm._blocks:
        assert block.ref_count == holders[block.block_id]
        if block.block_id in bm._free:
            assert block.hash is None
        if block.block_id in bm._evictable:
            assert block.hash is not None
        if block.hash is not None:
            assert bm._hash_to_block[block.hash] == block.block_id
    for h, block_id in bm._hash_to_block.items():
        assert bm._blocks[block_id].hash == h
    assert bm.num_free_blocks == len(free) + len(evictable)
    assert bm.usage == pytest.approx(len(referenced) / bm.num_blocks)


def test_prefix_hash_chains_over_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the partial last block has no hash
    assert block_hashes([1, 2, 3, 4], 2) == a[:2]
    assert block_hashes([9, 9, 3, 4], 2)[1] != a[1]  # same block tokens, different prefix
    assert block_hashes([5, 6], 2, parent=a[1]) == [a[2]]
    assert a[0] == chain_hash(None, (1, 2)) and a[1] == chain_hash(a[0], (3, 4))


def test_prefix_hash_is_sha256_of_the_parent_and_the_block_the_same_in_every_process() -> None:
    """sha256 over the parent's 8 bytes and the block's little-endian int32 ids, its first 8 bytes a
    signed int: a client choosing token ids cannot collide it (Python's tuple hash it could), and no
    PYTHONHASHSEED changes it."""

    def expected(parent: bytes, block: tuple[int, ...]) -> int:
        digest = hashlib.sha256(parent + struct.pack(f"<{len(block)}i", *block)).digest()[:8]
        return int.from_bytes(digest, "big", signed=True)

    first = expected(bytes(8), (1, 70000))
    second = expected(first.to_bytes(8, "big", signed=True), (3, 4))
    assert block_hashes([1, 70000, 3, 4, 5], 2) == [first, second]
    assert chain_hash(None, (1, 70000)) == first and chain_hash(first, (3, 4)) == second
    code = "from engine.prefix_hash import block_hashes; print(block_hashes(list(range(40)), 16))"
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        assert out.strip() == str(block_hashes(list(range(40)), 16))


def test_allocate_and_free_accounting() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", list(range(10))) == 0
    assert "a" in bm and "b" not in bm
    assert (
        len(bm.block_table("a")) == 3 and bm.num_free_blocks == 7 and bm.usage == pytest.approx(0.3)
    )
    assert bm.allocate("b", list(range(8)), num_extra_slots=1) == 0
    assert len(bm.block_table("b")) == 3
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    check_invariants(bm)
    bm.free("a")
    bm.free("b")
    assert "a" not in bm and bm.num_free_blocks == 10 and bm.usage == 0.0
    check_invariants(bm)


def test_prefix_hit_shares_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = list(range(100, 112))
    bm.allocate("a", a)
    bm.cache_blocks("a", a, len(a))
    b = a[:8] + [7, 7, 7, 7, 7]
    assert bm.peek_cached_tokens(b) == 8
    assert bm.allocate("b", b) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] not in bm.block_table("a")
    assert bm.num_free_blocks == 10 - 3 - 2
    check_invariants(bm)


def test_partial_block_never_matches() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = [1, 2, 3, 4, 5, 6]
    bm.allocate("a", a)
    bm.cache_blocks("a", a, len(a))
    assert bm.allocate("b", a + [7, 8, 9]) == 4
    # Tokens whose KV is not written yet are not cached either.
    c = list(range(50, 58))
    bm.allocate("c", c)
    bm.cache_blocks("c", c, 7)
    assert bm.peek_cached_tokens(c + [0]) == 4
    check_invariants(bm)


def test_full_prompt_hit_recomputes_last_block() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = list(range(8))
    bm.allocate("a", a)
    bm.cache_blocks("a", a, 8)
    assert bm.peek_cached_tokens(a) == 4
    assert bm.allocate("b", a) == 4
    assert bm.block_table("b")[0] == bm.block_table("a")[0]
    assert bm.block_table("b")[1] != bm.block_table("a")[1]
    assert bm.allocate("c", a + [9]) == 8
    assert bm.allocate("empty", []) == 0
    check_invariants(bm)


def test_colliding_hash_never_serves_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, block: 42)
    bm = BlockManager(num_blocks=10, block_size=4)
    a = [1, 2, 3, 4, 5]
    bm.allocate("a", a)
    bm.cache_blocks("a", a, 5)
    b = [6, 7, 8, 9, 10]
    assert bm.peek_cached_tokens(b) == 0
    assert bm.allocate("b", b) == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    check_invariants(bm)


def test_same_tokens_after_another_prefix_never_match(monkeypatch: pytest.MonkeyPatch) -> None:
    # A block's KV depends on its whole prefix: a hash blind to the parent must not let block 1 of
    # [X, X] serve position 0 of another prompt, though its tokens are X too.
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, block: hash(block))
    bm = BlockManager(num_blocks=10, block_size=2)
    x = [3, 4]
    bm.allocate("a", x + x + [0])
    bm.cache_blocks("a", x + x, 4)
    assert bm.allocate("b", x + [5, 6, 7]) == 0
    assert bm.block_table("a")[1] not in bm.block_table("b")
    check_invariants(bm)


def _cached_seq(bm: BlockManager, seq_id: str, tokens: list[int]) -> None:
    assert bm.allocate(seq_id, tokens) is not None
    bm.cache_blocks(seq_id, tokens, len(tokens))


def test_lru_evicts_least_recently_freed_and_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    _cached_seq(bm, "a", a)
    _cached_seq(bm, "b", b)
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    # The 2 never-used blocks go first, then a's tail, a's head, b's tail, b's head.
    expected_hits = [(4, 4), (4, 4), (2, 4), (0, 4), (0, 2), (0, 0)]
    for i, (hit_a, hit_b) in enumerate(expected_hits):
        assert bm.allocate(f"x{i}", [100 + i]) == 0
        assert (bm.peek_cached_tokens(a + [0]), bm.peek_cached_tokens(b + [0])) == (hit_a, hit_b)
        check_invariants(bm)
    assert bm.allocate("full", [0]) is None


def test_pinning_refreshes_lru_position() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = [1, 2], [3, 4]
    _cached_seq(bm, "a", a)
    _cached_seq(bm, "b", b)
    bm.free("a")
    bm.free("b")
    assert bm.allocate("c", a + [9]) == 2  # pins a's block: it leaves the evictable set
    assert bm.num_free_blocks == 2
    bm.free("c")  # a's block is now the most recently freed
    assert (
        bm.allocate("x", [7, 7, 7, 7, 7, 7]) == 0
    )  # 2 free blocks + c's private block + 1 eviction
    assert bm.peek_cached_tokens(b + [0]) == 0 and bm.peek_cached_tokens(a + [0]) == 2
    check_invariants(bm)


def test_eviction_removes_hash() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = [1, 2, 3, 4]
    _cached_seq(bm, "a", a)
    bm.free("a")
    assert bm.allocate("x", [9] * 6) == 0  # the free block, then both of a's
    assert not bm._hash_to_block
    bm.free("x")
    assert bm.peek_cached_tokens(a + [5]) == 0
    assert bm.allocate("a2", a + [5]) == 0
    check_invariants(bm)


def test_cache_blocks_idempotent_and_incremental(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []

    def counting_hash(parent: int | None, block: tuple[int, ...]) -> int:
        calls.append(block)
        return chain_hash(parent, block)

    monkeypatch.setattr(bm_module, "chain_hash", counting_hash)
    bm = BlockManager(num_blocks=10, block_size=4)
    tokens = list(range(3))
    bm.allocate("a", tokens, num_extra_slots=1)
    for t in range(3, 14):  # one decode step per token; KV of the newest token is written next step
        bm.cache_blocks("a", tokens, len(tokens))
        assert bm.ensure_capacity("a", len(tokens) + 1)
        tokens.append(t)
    bm.cache_blocks("a", tokens, len(tokens))
    bm.cache_blocks("a", tokens, len(tokens))
    assert calls == [
        tuple(range(4)),
        tuple(range(4, 8)),
        tuple(range(8, 12)),
    ]  # each block hashed once
    assert len(bm._hash_to_block) == 3
    assert bm.peek_cached_tokens(tokens) == 12
    check_invariants(bm)


def test_duplicate_prefix_computed_twice_keeps_one_entry() -> None:
    bm = BlockManager(num_blocks=12, block_size=4)
    prefix = list(range(8))
    assert bm.allocate("a", prefix + [1]) == 0
    assert bm.allocate("b", prefix + [2, 2, 2, 2, 2]) == 0  # both miss: computed concurrently
    bm.cache_blocks("a", prefix + [1], 9)
    bm.cache_blocks("b", prefix + [2, 2, 2, 2, 2], 13)
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    assert len(bm._hash_to_block) == 3
    assert set(bm._hash_to_block.values()) == {table_a[0], table_a[1], table_b[2]}
    # b's own new block chains onto a's equal blocks.
    assert bm.allocate("c", prefix + [2, 2, 2, 2, 2]) == 12
    assert bm.block_table("c")[:3] == table_a[:2] + table_b[2:3]
    bm.free("c")
    bm.free("b")
    # b's duplicates of a's blocks were private: freed, not cached; its own new block stays cached.
    assert table_b[0] in bm._free and table_b[1] in bm._free and table_b[3] in bm._free
    assert list(bm._evictable) == [table_b[2]]
    check_invariants(bm)


def test_usage_counts_only_referenced_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(16))
    _cached_seq(bm, "a", a)
    assert bm.usage == pytest.approx(0.5)
    assert bm.allocate("b", a[:8] + [0]) == 8
    assert bm.usage == pytest.approx(5 / 8)  # shared blocks count once
    bm.free("a")
    assert bm.usage == pytest.approx(3 / 8) and bm.num_free_blocks == 5
    bm.free("b")
    assert bm.usage == 0.0 and bm.num_free_blocks == 8


def _snapshot(bm: BlockManager) -> tuple:
    return (
        list(bm._free),
        list(bm._evictable),
        dict(bm._hash_to_block),
        {s: list(seq.table) for s, seq in bm._seqs.items()},
        [b.ref_count for b in bm._blocks],
    )


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = [1, 2, 3, 4, 5, 6]
    _cached_seq(bm, "a", a)
    bm.free("a")  # 3 evictable blocks, 1 free
    before = _snapshot(bm)
    # 3 cached blocks would be pinned, so only 1 block is left for the 2 new ones.
    assert bm.allocate("b", a + [7, 8, 9, 10]) is None
    assert bm.allocate("c", list(range(20, 30))) is None
    assert _snapshot(bm) == before and "b" not in bm
    assert bm.allocate("b", a + [7, 8]) == 6
    check_invariants(bm)


def test_ensure_capacity() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", [1, 2, 3, 4])
    assert bm.ensure_capacity("a", 4) and len(bm.block_table("a")) == 1
    assert bm.ensure_capacity("a", 5) and len(bm.block_table("a")) == 2
    table = bm.block_table("a")
    assert not bm.ensure_capacity("a", 17)
    assert bm.block_table("a") == table and bm.num_free_blocks == 2
    assert bm.ensure_capacity("a", 16) and len(bm.block_table("a")) == 4
    check_invariants(bm)


@pytest.mark.parametrize("weak_hash", [False, True])
def test_randomized_stress(weak_hash: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if (
        weak_hash
    ):  # constant collisions, blind to the prefix: correctness must not depend on the hash
        monkeypatch.setattr(bm_module, "chain_hash", lambda parent, block: hash(block) % 7)
    rng = random.Random(0)
    bs = 4
    bm = BlockManager(num_blocks=48, block_size=bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    prefixes += [
        [1, 2, 3, 4] * 4,
        [9, 9, 9, 9] + prefixes[0][4:],
    ]  # equal blocks after different prefixes
    finished: list[list[int]] = []
    kv: dict[int, tuple[int, ...]] = {}  # block id -> the token prefix its KV was computed for
    live: dict[str, tuple[list[int], int]] = {}  # seq id -> (token ids, num computed)
    hits = pool_full = 0

    def compute(seq_id: str, tokens: list[int], start: int, end: int) -> None:
        table = bm.block_table(seq_id)
        for i in range(start // bs, -(-end // bs)):
            assert bm._blocks[table[i]].hash is None, "a cached block must never be written again"
            kv[table[i]] = tuple(tokens[: min(end, (i + 1) * bs)])
        bm.cache_blocks(seq_id, tokens, end)

    for step in range(1500):
        op = rng.random()
        if op < 0.4 or not live:
            seq_id = f"s{step}"
            kind = rng.random()
            if kind < 0.1 and finished:  # the same prompt again: a full hit
                tokens = list(rng.choice(finished))
            else:  # a conversation's next turn, or a new one on a shared system prompt
                base = rng.choice(finished) if kind < 0.4 and finished else rng.choice(prefixes)
                tokens = base[: rng.randrange(len(base) + 1)] + [
                    rng.randrange(50) for _ in range(rng.randrange(1, 10))
                ]
            peek = bm.peek_cached_tokens(tokens)
            pool_full += not bm._free
            cached = bm.allocate(seq_id, tokens, num_extra_slots=rng.randrange(3))
            if cached is not None:
                assert cached == peek and cached % bs == 0 and cached < len(tokens)
                hits += cached > 0
                table = bm.block_table(seq_id)
                for i in range(cached // bs):  # the served KV is exactly this prompt's prefix
                    assert kv[table[i]] == tuple(tokens[: (i + 1) * bs])
                compute(seq_id, tokens, cached, len(tokens))
                live[seq_id] = (tokens, len(tokens))
        elif op < 0.75:
            seq_id = rng.choice(sorted(live))
            tokens, done = live[seq_id]
            if bm.ensure_capacity(seq_id, len(tokens) + 1):
                tokens.append(rng.randrange(50))
                compute(seq_id, tokens, done, len(tokens))
                live[seq_id] = (tokens, len(tokens))
        else:
            seq_id = rng.choice(sorted(live))
            bm.free(seq_id)
            finished.append(live.pop(seq_id)[0])
        check_invariants(bm)

    # The workload must exercise prefix hits and a full pool (hence eviction), or it proves little.
    assert hits > (10 if weak_hash else 100) and pool_full > 20
    for seq_id in list(live):
        bm.free(seq_id)
    check_invariants(bm)
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0


def test_the_routers_hashes_match_and_cache_as_the_tokens_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that brings its prompt's block hashes (the router's) is matched and cached under
    them without hashing its prompt again, and the cache is the same as if it had hashed them: a
    later request without hashes finds those blocks. Forged hashes only miss: the blocks' tokens
    are compared too."""
    bs = 4
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    hashes = block_hashes(prompt, bs)
    m = BlockManager(num_blocks=16, block_size=bs)
    calls = []
    monkeypatch.setattr(
        bm_module,
        "chain_hash",
        lambda parent, block: calls.append(block) or chain_hash(parent, block),
    )
    assert m.allocate("a", prompt, num_extra_slots=1, hashes=hashes) == 0
    m.cache_blocks("a", prompt, len(prompt))
    assert calls == [], "the prompt's blocks were hashed again"
    answer = prompt + [7, 7, 7]
    m.cache_blocks("a", answer, len(answer))
    assert calls == [tuple(answer[12:16])], "only the answer's new block is hashed"
    m.free("a")
    assert m.allocate("b", answer + [9], num_extra_slots=1) == 16, "found by the tokens' own hashes"
    m.free("b")
    forged = [h + 1 for h in hashes]
    assert m.allocate("c", prompt, num_extra_slots=1, hashes=forged) == 0
    m.free("c")
    other = [5] * 12
    assert m.allocate("d", other, num_extra_slots=1, hashes=hashes) == 0, (
        "another prompt's hashes serve nothing"
    )


def test_check_finds_every_kind_of_broken_book() -> None:
    """BlockManager.check proves the counts the rest relies on; each corruption below is one it must
    report."""

    def fresh() -> BlockManager:
        bm = BlockManager(8, 4)
        bm.allocate("a", list(range(12)))
        bm.cache_blocks("a", list(range(12)), 12)
        bm.allocate(
            "b", list(range(8)) + [99]
        )  # shares a's first two cached blocks; a's third becomes evictable
        bm.free("a")
        bm.check()
        assert bm._evictable and bm._free
        return bm

    corruptions = {
        "reference count": lambda bm: setattr(bm._blocks[bm.block_table("b")[0]], "ref_count", 5),
        "both free": lambda bm: bm._free.append(bm.block_table("b")[-1]),
        "neither": lambda bm: bm._free.pop(),
        "evictable block": lambda bm: setattr(bm._blocks[next(iter(bm._evictable))], "hash", None),
        "hash entry": lambda bm: bm._hash_to_block.update({12345: bm.block_table("b")[0]}),
        "twice": lambda bm: setattr(bm._seqs["b"], "table", np.repeat(bm._seqs["b"].table[:1], 2)),
    }
    for what, corrupt in corruptions.items():
        bm = fresh()
        corrupt(bm)
        with pytest.raises(AssertionError):
            bm.check()
