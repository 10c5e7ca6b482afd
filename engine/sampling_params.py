"""Per-request sampling parameters, as the workers receive them.

The API server validates user input (server/protocol.py) before building one of
these, so the engine only asserts invariants.
"""

from __future__ import annotations

import math

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

    def problem(self, vocab_size: int) -> str | None:
        """Why a worker cannot run these parameters (None when it can): the API server refuses such a request
        first, and a worker checks again so that no message can break it."""
        if not (0.0 <= self.temperature < math.inf):
            return f"temperature {self.temperature} must be a finite number >= 0"
        if not (0.0 < self.top_p <= 1.0):
            return f"top_p {self.top_p} must be in (0, 1]"
        if self.top_k < 0:
            return f"top_k {self.top_k} must be >= 0 (0: no cut)"
        if self.max_tokens < 1 or not (0 <= self.min_tokens <= self.max_tokens):
            return f"need 0 <= min_tokens ({self.min_tokens}) <= max_tokens ({self.max_tokens}) and max_tokens >= 1"
        if bad := [t for t in self.stop_token_ids if not 0 <= t < vocab_size]:
            return f"stop token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
        return None
