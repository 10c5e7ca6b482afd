"""Chained hashes of full token blocks, the same in every process.

The API server's router and the decode worker must agree on these values, so
only ints and tuples of ints are hashed: an int hashes to its value mod 2**61-1
and a tuple combines its items' hashes (xxHash-style), neither salted by
PYTHONHASHSEED (only str/bytes/datetime are). Checked on Python 3.11 across
processes with different PYTHONHASHSEED values. Never put str, bytes or None in
the tuple: None hashes to its address before Python 3.12.
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_hash(parent: int | None, block: tuple[int, ...]) -> int:
    """Hash of one full block given its predecessor's chain hash (None for the first block)."""
    return hash(block) if parent is None else hash((parent, block))


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """One hash per full block of token_ids (Python ints), each covering the whole prefix up to and including it.

    parent is the chain hash of the blocks before token_ids, if they are a continuation.
    """
    hashes: list[int] = []
    h = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        # chain_hash inlined: this runs on every request in the API server.
        h = hash(block) if h is None else hash((h, block))
        hashes.append(h)
    return hashes
