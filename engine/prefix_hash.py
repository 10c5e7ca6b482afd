"""Chained hashes of full token blocks: the same in every process, and not for a client to collide.

A block's hash is the first 8 bytes of sha256(its parent's hash, 8 bytes big-endian, then its token
ids as little-endian int32), read as a signed 64-bit int; a sequence's first block has 8 zero bytes
for a parent. So a hash covers the whole prefix up to its block, and the API server's router and the
decode worker compute the same values whatever their PYTHONHASHSEED.

A cryptographic hash because a client chooses token ids: Python's hash of a tuple of ints is
unsalted and cheap to invert, so a client could craft blocks that take the cache entries of another
conversation's (vLLM moved to sha256 for this). 64 bits suffice: forcing a given hash takes about
2**64 tries, and a collision can only cost a cache entry, never serve wrong KV (the block manager
also compares the block's token ids and its parent).

Not engine/kv_events.BlockHasher: that one must be vLLM's byte for byte (pickle or CBOR, a seed,
32-byte parents) and runs only with KV-cache events on; these ints travel with every request and key
the router's index.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import sha256

_ROOT = bytes(8)  # the parent of a sequence's first block


def chain_hash(parent: int | None, block: Sequence[int]) -> int:
    """Hash of one full block given its predecessor's chain hash (None for the first block)."""
    head = _ROOT if parent is None else parent.to_bytes(8, "big", signed=True)
    return int.from_bytes(sha256(head + _int32s(block)).digest()[:8], "big", signed=True)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """One hash per full block of token_ids (token ids below 2**31), each covering the whole prefix
    up to and including it. parent is the chain hash of the blocks before token_ids, if they are
    a continuation."""
    data = _int32s(token_ids[: len(token_ids) // block_size * block_size])
    step = 4 * block_size
    digest = _ROOT if parent is None else parent.to_bytes(8, "big", signed=True)
    digests = []
    for start in range(
        0, len(data), step
    ):  # this runs on every request in the API server: one call a block
        digest = sha256(digest + data[start : start + step]).digest()[:8]
        digests.append(digest)
    return [int.from_bytes(d, "big", signed=True) for d in digests]


def _int32s(ids: Sequence[int]) -> bytes:
    """ids as little-endian int32s, whatever this machine's byte order."""
    packed = array("i", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()
