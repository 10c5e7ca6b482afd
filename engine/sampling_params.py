"""Per-request sampling parameters, as the workers receive them.

The API server validates user input (server/protocol.py) before building one of
these, so the engine only asserts invariants.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick the next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) means no top-k cut. seed makes
    sampling reproducible: the noise for output token i depends only on
    (seed, i), so it is the same whichever worker samples that token.
    Stop strings are matched on text by the API server, not here.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
