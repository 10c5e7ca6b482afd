"""Paged KV block allocator with prefix caching; the decode worker is its only owner.

A block is in exactly one state: free (in the free list), referenced (by at
least one live sequence's table) or evictable (cached, unreferenced, in the
LRU). A cached block has a chain hash, its token ids and the serial of the
cached block before it; a prefix matches only if all three agree, so neither a
hash collision nor a parent block evicted and reused for other tokens can ever
serve wrong KV.

With a BlockHasher (KV-cache events on), each cached block also carries its
vLLM block hash, and every block cached or dropped is recorded as a vLLM
BlockStored / BlockRemoved event for the decode worker to publish.

With a second tier (a TierIndex, engine/kv_tier.py), a cached block the LRU
evicts is offered to the tier first, and a prompt whose cached prefix runs on
in the tier gets fresh blocks loaded from it: the copies are recorded here and
run by the decode worker (take_copies, copies_done).

Retention (free's retain_s: the clients' cache hints) keeps a sequence's cached
blocks out of the plain LRU until their time is up, for at most
retention_share of the pool: the LRU evicts every plain block before a
retained one.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.kv_events import BlockHasher, KVCacheEvent, removed, stored
from engine.kv_tier import KVCopy, TierIndex
from engine.prefix_hash import chain_hash

_ROOT = 0  # parent serial of a sequence's first block; real serials start at 1
_MISSING = object()


class Block:
    """One KV block: reference count and, once cached, its hash, token ids, serial and parent's
    serial."""

    __slots__ = (
        "block_id",
        "ext",
        "hash",
        "parent",
        "parent_hash",
        "ref_count",
        "serial",
        "token_ids",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        self.hash: int | None = None
        self.ext: bytes | None = None  # the vLLM block hash, with KV-cache events on
        self.token_ids: tuple[int, ...] | None = None
        # A fresh serial per registration: a child records its parent's serial, so reusing the
        # parent's block for other tokens breaks the link even if the new content hashes the same.
        self.serial = _ROOT
        self.parent = _ROOT
        self.parent_hash: int | None = None  # the chain hash of the block before (for the tier)


@dataclass(slots=True)
class _Seq:
    table: (
        np.ndarray
    )  # int32 block ids; replaced, never changed in place, when it grows (table_array hands it out)
    num_hashed: int  # leading blocks already matched or registered in the cache
    last_hash: int | None
    last_serial: int
    last_ext: bytes | None  # the vLLM hash of the last hashed block (KV-cache events on)
    hashes: Sequence[
        int
    ] = ()  # the chain hashes of its leading full blocks, where the caller had them


class BlockManager:
    """Allocates KV blocks to sequences and keeps finished prefixes cached (ref-counted,
    LRU-evicted)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hasher: BlockHasher | None = None,
        tier: TierIndex | None = None,
        retention_share: float = 0.0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher
        self.tier = tier
        self.max_retained = int(retention_share * num_blocks)
        self.events: list[KVCacheEvent] = []  # since the last take_events(), with a hasher
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        # Evictable blocks whose retention has not expired: block id -> time.monotonic() it ends.
        self._retained: OrderedDict[int, float] = OrderedDict()
        self._next_expiry = float("inf")
        # An allocation waited for a tier store that had not completed (allocate returned None):
        # the caller schedules again once the copies it ran are done, instead of going idle.
        self.awaiting_tier = False
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[str, _Seq] = {}
        self._serials = itertools.count(_ROOT + 1)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: never-used/freed ones plus cached blocks no live sequence
        references."""
        return len(self._free) + len(self._evictable) + len(self._retained)

    @property
    def num_retained(self) -> int:
        """Evictable blocks a retention hint keeps behind the plain LRU now."""
        return len(self._retained)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one live sequence (vLLM's
        kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def allocate(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_extra_slots: int = 0,
        use_cache: bool = True,
        hashes: Sequence[int] = (),
    ) -> int | None:
        """Pin the longest cached prefix of token_ids (none when not use_cache) and allocate blocks
        for the rest plus num_extra_slots slots. hashes: the chain hashes of token_ids' leading
        full blocks where the caller has them (the router's, which came with the request):
        matching and caching those blocks then hashes nothing.

        Returns the number of cached tokens (always < len(token_ids) when token_ids is non-empty),
        or None, changing nothing, if there are not enough free blocks.
        """
        assert seq_id not in self._seqs, f"sequence {seq_id!r} is already allocated"
        self._expire()
        matched = self._match(token_ids, hashes) if use_cache else []
        in_tier, storing = ([], False)
        if use_cache:
            in_tier, storing = self._match_tier(token_ids, hashes, matched)
        if storing:
            # The prefix goes on in a block the tier is storing now (evicted by an allocation of
            # this same schedule): waiting for the copy beats computing the rest of the prefix.
            self.awaiting_tier = True
            return None
        if (matched or in_tier) and (len(matched) + len(in_tier)) * self.block_size == len(
            token_ids
        ):
            # At least one token must run to produce logits; recomputing the whole last block into a
            # fresh one keeps cached blocks immutable.
            (in_tier or matched).pop()
        num_new = self._num_blocks_for(len(token_ids) + num_extra_slots) - len(matched)
        num_revived = sum(1 for block in matched if block.ref_count == 0)
        if num_new > self.num_free_blocks - num_revived:
            return None
        for block in matched:
            if block.ref_count == 0:
                self._unevict(block.block_id)
            block.ref_count += 1
        for h in in_tier:  # before _take, whose evictions go to the tier and may drop its LRU
            self.tier.pin(h)  # type: ignore[union-attr]
        new = [self._take() for _ in range(num_new)]
        for h, block_id in zip(in_tier, new):
            self.tier.load(h, block_id)  # type: ignore[union-attr]
        table = np.array([block.block_id for block in matched] + new, np.int32)
        last = matched[-1] if matched else None
        self._seqs[seq_id] = _Seq(
            table,
            len(matched),
            last.hash if last else None,
            last.serial if last else _ROOT,
            last.ext if last else None,
            hashes,
        )
        return (len(matched) + len(in_tier)) * self.block_size

    def take_copies(self) -> list[KVCopy]:
        """The copies between the pool and the tier recorded since the last call, in order: the
        decode worker runs them before the step or prefill job that touches their blocks, then
        calls copies_done."""
        return self.tier.take_copies() if self.tier is not None else []

    def copies_done(self, copies: Sequence[KVCopy]) -> None:
        """Copies from take_copies completed: their stores become visible in the tier."""
        if self.tier is not None:
            self.tier.copies_done(copies)
            self.awaiting_tier = False

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block ids, in token order."""
        return self._seqs[seq_id].table.tolist()

    def table_array(self, seq_id: str) -> np.ndarray:
        """The sequence's block ids as an int32 array, without a copy: what a step's input holds.
        The manager never writes into it; growing the table makes a new array, so a step keeps
        the table it was built with."""
        return self._seqs[seq_id].table

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the sequence's table to cover num_tokens slots; False (and no change) if not enough
        blocks are free."""
        seq = self._seqs[seq_id]
        num_new = self._num_blocks_for(num_tokens) - len(seq.table)
        if num_new <= 0:
            return True
        self._expire()
        if num_new > self.num_free_blocks:
            return False
        seq.table = np.concatenate(
            [seq.table, np.array([self._take() for _ in range(num_new)], np.int32)]
        )
        return True

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register as cached every full block among the first num_computed of token_ids (prompt +
        generated ids).

        Idempotent and incremental. If an equal block is already cached (the same prefix computed
        concurrently), that entry stays and this sequence's block stays private, freed normally.
        """
        seq = self._seqs[seq_id]
        bs = self.block_size
        num_full = min(num_computed, len(token_ids)) // bs
        assert num_full <= len(seq.table), "KV written beyond the sequence's blocks"
        run: list[Block] = []  # blocks newly cached in a row, for one BlockStored event
        run_parent = seq.last_ext
        for i in range(seq.num_hashed, num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = seq.hashes[i] if i < len(seq.hashes) else chain_hash(seq.last_hash, tokens)
            ext = self.hasher.block(seq.last_ext, tokens) if self.hasher else None
            existing = self._hash_to_block.get(h)
            if existing is not None:
                other = self._blocks[existing]
                if other.token_ids == tokens and other.parent == seq.last_serial:
                    self._record_stored(run, run_parent)
                    run, run_parent = [], other.ext
                    seq.last_hash, seq.last_serial, seq.last_ext = h, other.serial, other.ext
                    continue
                # A collision, or an orphan whose parent was evicted: neither can ever match, so
                # make way.
                if any(
                    b is other for b in run
                ):  # a collision within this sequence: report it stored, then removed
                    self._record_stored(run, run_parent)
                    run, run_parent = [], seq.last_ext
                self._uncache(other)
            block = self._blocks[seq.table[i]]
            assert block.hash is None and block.ref_count > 0
            block.hash, block.token_ids, block.parent, block.ext = h, tokens, seq.last_serial, ext
            block.parent_hash = seq.last_hash
            block.serial = next(self._serials)
            self._hash_to_block[h] = block.block_id
            seq.last_hash, seq.last_serial, seq.last_ext = h, block.serial, ext
            run.append(block)
        self._record_stored(run, run_parent)
        seq.num_hashed = max(seq.num_hashed, num_full)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events recorded since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def free(self, seq_id: str, retain_s: float = 0.0) -> None:
        """Drop the sequence's references; unreferenced cached blocks become evictable, others
        free. retain_s: keep its cached blocks behind the plain LRU for this many seconds (as far
        as the retained share of the pool has room)."""
        until = time.monotonic() + retain_s
        # Tail first, so the LRU evicts a prefix's tail before its head (the head is likelier to be
        # shared).
        for block_id in reversed(self._seqs.pop(seq_id).table.tolist()):
            block = self._blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(block_id)
                elif retain_s > 0 and len(self._retained) < self.max_retained:
                    self._retained[block_id] = until
                    self._next_expiry = min(self._next_expiry, until)
                else:
                    self._evictable[block_id] = None

    def holders(self) -> set[str]:
        """The sequences that hold blocks."""
        return set(self._seqs)

    def check(self) -> None:
        """Raise AssertionError where the books disagree: every block free, evictable or referenced,
        exactly one of them; each block's reference count the number of tables holding it; an
        evictable block cached; the hash index and the blocks' hashes the same map both ways; a
        table's blocks distinct."""
        refs: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            table = seq.table.tolist()
            _check(len(set(table)) == len(table), f"{seq_id}'s table holds a block twice")
            for block_id in table:
                refs[block_id] = refs.get(block_id, 0) + 1
        free, evictable = set(self._free), set(self._evictable) | set(self._retained)
        _check(
            not set(self._evictable) & set(self._retained), "a block both retained and plain LRU"
        )
        _check(len(self._retained) <= self.max_retained, "more blocks retained than the share")
        if self.tier is not None:
            self.tier.check()
        _check(len(free) == len(self._free), "a block listed free twice")
        _check(
            not (free & evictable) and not (free & refs.keys()) and not (evictable & refs.keys()),
            "a block both free, evictable or referenced",
        )
        _check(
            len(free) + len(evictable) + len(refs) == self.num_blocks,
            "a block neither free, evictable nor held",
        )
        for block in self._blocks:
            _check(
                block.ref_count == refs.get(block.block_id, 0),
                f"block {block.block_id}'s reference count",
            )
            if block.hash is not None:
                _check(
                    self._hash_to_block.get(block.hash) == block.block_id,
                    f"block {block.block_id}'s hash entry",
                )
        for block_id in evictable:
            _check(
                self._blocks[block_id].hash is not None, f"evictable block {block_id} is not cached"
            )
        for h, block_id in self._hash_to_block.items():
            _check(self._blocks[block_id].hash == h, f"hash entry of block {block_id}")

    def peek_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens allocate() would report as cached right now, without pinning."""
        matched = self._match(token_ids)
        num_matched = len(matched) + len(self._match_tier(token_ids, (), matched)[0])
        if num_matched and num_matched * self.block_size == len(token_ids):
            num_matched -= 1
        return num_matched * self.block_size

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match(self, token_ids: Sequence[int], hashes: Sequence[int] = ()) -> list[Block]:
        matched: list[Block] = []
        h, parent = None, _ROOT
        bs = self.block_size
        for i, start in enumerate(range(0, len(token_ids) - bs + 1, bs)):
            tokens = tuple(token_ids[start : start + bs])
            h = hashes[i] if i < len(hashes) else chain_hash(h, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.token_ids != tokens or block.parent != parent:
                break
            matched.append(block)
            parent = block.serial
        return matched

    def _match_tier(
        self, token_ids: Sequence[int], hashes: Sequence[int], matched: list[Block]
    ) -> tuple[list[int], bool]:
        """The chain hashes of the blocks after `matched` (the pool's) that continue in the tier,
        and whether the first block after them is one the tier is storing now."""
        found: list[int] = []
        if self.tier is None:
            return found, False
        bs = self.block_size
        h = matched[-1].hash if matched else None
        for i in range(len(matched), len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent, h = h, hashes[i] if i < len(hashes) else chain_hash(h, tokens)
            if not self.tier.find(h, parent, tokens):
                return found, self.tier.storing(h, parent, tokens)
            found.append(h)
        return found, False

    def _take(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            if self._evictable:
                block_id, _ = self._evictable.popitem(last=False)
            else:  # only retained blocks left: the one whose retention ends first
                block_id = min(self._retained, key=self._retained.__getitem__)
                del self._retained[block_id]
            block = self._blocks[block_id]
            if self.tier is not None:
                self.tier.offer(block.hash, block.parent_hash, block.token_ids, block_id)  # type: ignore[arg-type]
            self._forget(block)
        self._blocks[block_id].ref_count = 1
        return block_id

    def _unevict(self, block_id: int) -> None:
        """A cached block no sequence held is pinned again: out of the LRU it was in."""
        if self._evictable.pop(block_id, _MISSING) is _MISSING:
            del self._retained[block_id]

    def _expire(self) -> None:
        """Retained blocks whose time is up join the plain LRU, first in line (each has gone unused
        for its whole retention)."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        expired = [b for b, until in self._retained.items() if until <= now]
        for block_id in reversed(expired):
            del self._retained[block_id]
            self._evictable[block_id] = None
            self._evictable.move_to_end(block_id, last=False)
        self._next_expiry = min(self._retained.values(), default=float("inf"))

    def _forget(self, block: Block) -> None:
        assert block.hash is not None and self._hash_to_block[block.hash] == block.block_id
        del self._hash_to_block[block.hash]
        if self.hasher is not None:
            self.events.append(removed([self.hasher.external(block.ext)]))
        block.reset()

    def _record_stored(self, run: list[Block], parent: bytes | None) -> None:
        """One BlockStored for blocks of one sequence cached in a row; parent: the vLLM hash of the
        block before."""
        if not run or self.hasher is None:
            return
        ext = self.hasher.external
        self.events.append(
            stored(
                [ext(b.ext) for b in run],
                None if parent is None else ext(parent),
                [t for b in run for t in b.token_ids],
                self.block_size,
            )
        )

    def _uncache(self, block: Block) -> None:
        self._forget(block)
        if block.ref_count == 0:
            self._unevict(block.block_id)
            self._free.append(block.block_id)


def _check(ok: bool, what: str) -> None:
    if not ok:  # not `assert`: checked under python -O too
        raise AssertionError(f"block manager: {what}")
