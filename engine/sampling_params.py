"""Per-request sampling parameters, as the workers receive them.

The API server validates user input (server/protocol.py) before building one of
these, so the engine only checks what a message could break.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit for top_logprobs)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = (
    0.01,
    100.0,
)  # logits divided or multiplied by it stay finite
GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]


class GuidedSpec(msgspec.Struct, frozen=True):
    """What the output must match (structured outputs). value: the JSON schema as JSON text
    (json_schema), the regex (regex), the choices as a JSON list of strings (choice), the EBNF
    grammar (grammar), the structural tag as JSON (structural_tag), or "" (json_object: any JSON
    object)."""

    kind: GuidedKind
    value: str = ""
    # token ids ending a free prefix (a reasoning model's </think>): the grammar holds for the
    # output after their first occurrence, and nothing is masked before it; () : from the start
    after: tuple[int, ...] = ()


# Temperatures below this are greedy, as in vLLM: logits divided by one were infinite (fuzzing sent
# 5e-324, which is 0 in float32), and the draw left the grammar mask.
SAMPLING_EPS = 1e-5


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick the next token and when to stop.

    temperature 0 (or below SAMPLING_EPS) means greedy. top_k 0 (or -1) means no top-k cut. seed
    makes sampling reproducible: the noise for output token i depends only on (seed, i), so it is
    the same whichever worker samples that token. Stop strings are matched on text by the API
    server, not here.

    The logits a token is drawn from are the model's, then the penalties (repetition over prompt and
    output, Hugging Face's; frequency and presence over the output, OpenAI's), logit_bias, the
    min_tokens ban and the grammar mask (guided), in that order; logprobs report that distribution
    (before temperature, min_p, top-k and top-p, which only narrow what is drawn). logprobs: None
    for none, else the number of top alternatives (0..20) beside the sampled token's;
    prompt_logprobs likewise for each prompt token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: GuidedSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Whether the penalties need the request's token history."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def problem(self, vocab_size: int) -> str | None:
        """Why a worker cannot run these parameters (None when it can): the API server refuses such
        a request first, and a worker checks again so that no message can break it."""
        if not (0.0 <= self.temperature < math.inf):
            return f"temperature {self.temperature} must be a finite number >= 0"
        if not (0.0 < self.top_p <= 1.0):
            return f"top_p {self.top_p} must be in (0, 1]"
        if not (0.0 <= self.min_p <= 1.0):
            return f"min_p {self.min_p} must be in [0, 1]"
        if self.top_k < 0:
            return f"top_k {self.top_k} must be >= 0 (0: no cut)"
        if self.max_tokens < 1 or not (0 <= self.min_tokens <= self.max_tokens):
            return (
                f"need 0 <= min_tokens ({self.min_tokens}) <= max_tokens ({self.max_tokens})"
                " and max_tokens >= 1"
            )
        if bad := [t for t in self.stop_token_ids if not 0 <= t < vocab_size]:
            return f"stop token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
        if not all(math.isfinite(x) for x in (self.presence_penalty, self.frequency_penalty)):
            return "presence_penalty and frequency_penalty must be finite numbers"
        if not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            return (
                f"repetition_penalty {self.repetition_penalty} must be in "
                f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"
            )
        ids = [t for t, _ in self.logit_bias]
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            return f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
        if len(set(ids)) < len(ids) or not all(math.isfinite(b) for _, b in self.logit_bias):
            return "logit_bias needs unique token ids and finite biases"
        for name, n in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                return f"{name} {n} must be in 0..{MAX_LOGPROBS}"
        return None


class RequestFailure(Exception):
    """A request cannot go on for a reason of its own (its grammar, its parameters), not the
    engine's: a step in which only such failures happen says nothing about the device."""


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One sampled token's log-probability, its rank in the distribution (1: the most likely), and
    the top alternatives (ids and log-probabilities, most likely first; as many as the request
    asked for)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]
