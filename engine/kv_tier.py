"""The second KV tier: full prefix-cache blocks the pool evicts, kept behind it and loaded back.

Two halves, in two places. `TierIndex` is bookkeeping only and lives with the block manager in the
decode worker (rank 0): which chain hashes the tier holds, in which slot, least recently used
first. `TierStore` holds the bytes and lives with each rank's engine: on a GPU host, pinned host
memory copied on a stream of its own; on the CPU a file-backed pool on local disk (mapped shared,
the file unlinked once mapped, so a crash leaves no file behind and a restart starts empty).

The block manager records copies (`KVCopy`: a pool block into a tier slot when the pool evicts a
cached block, a tier slot into a fresh pool block when a prompt's prefix continues in the tier);
the decode worker hands them to the engine before the step or prefill job that needs them, and
tells the index when they are done. So:

- an entry is found only once its store completed (`ready`): a half-written slot is never read;
- an entry a load reads is pinned until that load completed: no store reuses its slot meanwhile;
- a pool block a store reads is the one the pool is taking for someone else, and the copies run
  in the order recorded, before the step that writes the block: it is never read back stale.

A slot holds one block of every layer, K and V: (num_layers, 2, block_size, kv_heads, head_dim),
so one block is one contiguous run of bytes in the tier.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger("ppd.kv_tier")

GIB = 1 << 30


class KVCopy(NamedTuple):
    """One block's copy between the pool and the tier: store (pool -> tier) or load (tier ->
    pool)."""

    store: bool
    block_id: int
    slot: int


@dataclass(slots=True)
class _Entry:
    slot: int
    token_ids: tuple[int, ...]
    parent: int | None  # the chain hash of the block before (None: a sequence's first block)
    ready: bool = False  # its store completed
    pins: int = 0  # loads recorded from it and not yet done


@dataclass(slots=True)
class TierStats:
    """Counts since start, in blocks (bytes: times the block's bytes)."""

    stored: int = 0  # stores completed
    loaded: int = 0  # loads completed
    dropped: int = 0  # entries the tier's LRU let go, and evicted blocks it had no room for


class TierIndex:
    """Which blocks the tier holds (by chain hash), its slots and its LRU; the copies to run."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a KV tier needs room for at least one block")
        self.capacity = capacity
        self.stats = TierStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self._copies: list[KVCopy] = []  # recorded, not handed out yet
        self._by_slot: dict[int, int] = {}  # slot -> hash, for the entries of copies in flight

    @property
    def num_blocks(self) -> int:
        """Blocks the tier holds or is storing."""
        return len(self._entries)

    @property
    def usage(self) -> float:
        return len(self._entries) / self.capacity

    def offer(self, h: int, parent: int | None, token_ids: tuple[int, ...], block_id: int) -> None:
        """The pool is evicting cached block `block_id` (chain hash h): keep a copy, unless the tier
        holds it already (a block loaded back and evicted again) or has no slot to give."""
        entry = self._entries.get(h)
        if entry is not None and entry.token_ids == token_ids and entry.parent == parent:
            self._entries.move_to_end(h)
            return
        if entry is not None:  # the same hash for other tokens: never serve it
            if not entry.ready or entry.pins:  # a copy still reads or writes its slot
                self.stats.dropped += 1
                return
            self._drop(h)
        slot = self._slot()
        if slot is None:
            self.stats.dropped += 1
            return
        self._entries[h] = _Entry(slot, token_ids, parent)
        self._by_slot[slot] = h
        self._copies.append(KVCopy(True, block_id, slot))

    def find(self, h: int, parent: int | None, token_ids: tuple[int, ...]) -> bool:
        """Whether a completed copy of this block (same hash, tokens and parent) is in the tier."""
        entry = self._entries.get(h)
        return (
            entry is not None
            and entry.ready
            and entry.token_ids == token_ids
            and entry.parent == parent
        )

    def storing(self, h: int, parent: int | None, token_ids: tuple[int, ...]) -> bool:
        """Whether this block's store is recorded or in flight, not yet done: found once it is."""
        entry = self._entries.get(h)
        return (
            entry is not None
            and not entry.ready
            and entry.token_ids == token_ids
            and entry.parent == parent
        )

    def pin(self, h: int) -> None:
        """Keep the entry (found a moment ago) until a load from it is recorded and done."""
        self._entries[h].pins += 1

    def load(self, h: int, block_id: int) -> None:
        """Copy the pinned entry h into pool block block_id (unpinned when the copy is done)."""
        entry = self._entries[h]
        assert entry.ready and entry.pins > 0
        self._entries.move_to_end(h)
        self._copies.append(KVCopy(False, block_id, entry.slot))

    def take_copies(self) -> list[KVCopy]:
        """The copies recorded since the last call, in order: run them before anything reads or
        writes their blocks, then call copies_done."""
        copies, self._copies = self._copies, []
        return copies

    def copies_done(self, copies: Sequence[KVCopy]) -> None:
        """The copies have completed on the device: stored entries become visible, loaded ones are
        unpinned."""
        for copy in copies:
            h = self._by_slot.get(copy.slot)
            entry = self._entries.get(h) if h is not None else None
            if entry is None or entry.slot != copy.slot:
                continue  # dropped meanwhile (a hash reused for other tokens)
            if copy.store:
                entry.ready = True
                self.stats.stored += 1
            else:
                entry.pins -= 1
                self.stats.loaded += 1

    def check(self) -> None:
        """Raise AssertionError where the books disagree: each slot free or one entry's."""
        slots = [e.slot for e in self._entries.values()]
        _check(len(set(slots)) == len(slots), "a tier slot held by two entries")
        _check(not set(slots) & set(self._free), "a tier slot both free and held")
        _check(len(slots) + len(self._free) == self.capacity, "a tier slot neither free nor held")
        for h, entry in self._entries.items():
            _check(self._by_slot.get(entry.slot) == h, "a tier slot's owner")
            _check(entry.pins >= 0, "a tier entry pinned fewer than zero times")

    def _slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, entry in self._entries.items():  # least recently used first
            if entry.ready and not entry.pins:
                self._drop(h)  # its slot goes last in the free list
                self.stats.dropped += 1
                return self._free.pop()
        return None  # every slot pinned or being stored

    def _drop(self, h: int) -> None:
        entry = self._entries.pop(h)
        del self._by_slot[entry.slot]
        self._free.append(entry.slot)


class TierStore:
    """The tier's bytes on one rank: `capacity` slots of one pool block each, and the copies
    between them and the pool (`run`)."""

    def __init__(self, pool: Any, capacity: int, folder: Path | None = None) -> None:
        import torch

        self.pool = pool  # (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
        shape = (capacity, pool.shape[0], pool.shape[1], *pool.shape[3:])
        self.capacity = capacity
        self.block_nbytes = block_nbytes(pool)
        if pool.is_cuda:
            self.data = torch.empty(shape, dtype=pool.dtype, pin_memory=True)
            self.stream = torch.cuda.Stream(device=pool.device)
            self.path = None
        else:
            folder = Path(folder or default_folder())
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="kv-tier-", suffix=".bin", dir=folder)
            os.close(fd)
            try:
                numel = capacity * self.block_nbytes // pool.element_size()
                flat = torch.from_file(name, shared=True, size=numel, dtype=pool.dtype)
            finally:
                os.unlink(name)  # the mapping stays; no file outlives the process
            self.data = flat.view(shape)
            self.stream = None
            self.path = folder

    def run(self, copies: Sequence[KVCopy]) -> Any:
        """Run the copies in order. On the CPU they are done when this returns (None); on a GPU they
        are queued on the tier's stream behind the work already queued on the current one, and
        the returned event marks their end: the current stream waits for it before its next step
        writes or reads the blocks, and whoever else touches them waits for the event itself."""
        import torch

        if self.stream is None:
            self._copy(copies)
            return None
        current = torch.cuda.current_stream(self.pool.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self._copy(copies, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        current.wait_event(done)
        return done

    def _copy(self, copies: Sequence[KVCopy], non_blocking: bool = False) -> None:
        # One copy per block: a slot is contiguous, and a pool block's layers are strided runs of
        # block_size * kv_heads * head_dim; an indexed copy of many blocks at once gathers through
        # a temporary and ran at a fifth of this on the CPU (docs/design.md, the second tier).
        data, pool = self.data, self.pool
        for copy in copies:
            if copy.store:
                data[copy.slot].copy_(pool[:, :, copy.block_id], non_blocking=non_blocking)
            else:
                pool[:, :, copy.block_id].copy_(data[copy.slot], non_blocking=non_blocking)


def block_nbytes(pool: Any) -> int:
    """Bytes of one block of the pool (every layer, K and V): what a tier slot holds."""
    return pool[:, :, 0].numel() * pool.element_size()


def tier_capacity(size_gib: float, nbytes: int) -> int:
    """Blocks of nbytes that size_gib holds."""
    return int(size_gib * GIB) // nbytes


def default_folder() -> Path:
    """Where the CPU tier's file goes without --kv-offloading-dir: the cache folder's kv-tier/."""
    from profiles import cache_dir

    return Path(cache_dir()) / "kv-tier"


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"KV tier: {what}")
