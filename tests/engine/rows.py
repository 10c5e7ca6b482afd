"""Sampler rows for tests that give parameters and output indices only (no token history)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from engine.sampler import Row, Sampler
from engine.sampling_params import SamplingParams


def rows(params: Sequence[SamplingParams], output_indices: Sequence[int]) -> list[Row]:
    """One row per request: a one-token prompt and output_indices[i] tokens of output (all token
    0)."""
    return [
        Row(p, [0] * (1 + i), 1, str(n))
        for n, (p, i) in enumerate(zip(params, output_indices, strict=True))
    ]


def draw(
    sampler: Sampler,
    logits: Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
) -> list[int]:
    """The tokens sampler picks for these rows."""
    return sampler(logits, rows(params, output_indices)).tokens
