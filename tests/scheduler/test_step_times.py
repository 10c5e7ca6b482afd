"""The decode worker's split of its step times into a decode step and what an inline prefill adds:
per token, and of a mixture of experts per expert it reads that the decode tokens do not."""

from __future__ import annotations

import pytest

from engine.config import expected_experts
from engine.model_runner import StepInput
from scheduler.decode_worker import StepTimes

DECODE_MS = 10.0


def experts(n: float) -> float:
    """4 MoE layers, 32 experts, top 2."""
    return expected_experts(n, 4, 32, 2)


def step(times: StepTimes, batch: int, prefill: int, ms: float) -> None:
    inputs = [StepInput([1], 100, [0]) for _ in range(batch)]
    if prefill:
        inputs.append(StepInput([1] * prefill, 100, [0]))
    times.record(inputs, ms / 1000)


def test_a_dense_model_has_one_cost_per_inline_token() -> None:
    times = StepTimes()
    step(times, 8, 0, DECODE_MS)
    step(times, 8, 100, DECODE_MS + 5.0)
    assert times.decode_step_ms == DECODE_MS
    assert times.inline_tokens_per_s == pytest.approx(100 / 0.005)
    assert times.expert_ms == 0.0


def test_a_mixture_of_experts_splits_an_inline_prefill_into_tokens_and_experts_read() -> None:
    """Prefills of several sizes over several batch sizes: the fit finds both costs."""
    per_token, per_expert = 0.05, 0.2
    times = StepTimes(experts)
    step(times, 4, 0, DECODE_MS)
    for _ in range(20):
        for batch, new in ((1, 8), (16, 64), (4, 256), (32, 16), (2, 32)):
            added = experts(batch + new) - experts(batch)
            step(times, batch, new, DECODE_MS + new * per_token + added * per_expert)
    assert times.expert_ms == pytest.approx(per_expert, rel=1e-6)
    assert times.inline_tokens_per_s == pytest.approx(1000 / per_token, rel=1e-6)


def test_a_mixture_of_experts_that_saw_one_prefill_size_charges_it_to_its_tokens() -> None:
    """One size over one batch cannot tell tokens from experts (they come in proportion): the fit
    does not invent an expert cost, and still predicts that prefill."""
    times = StepTimes(experts)
    step(times, 4, 0, DECODE_MS)
    for _ in range(10):
        step(times, 4, 64, DECODE_MS + 8.0)
    assert times.expert_ms == 0.0
    assert 64 / times.inline_tokens_per_s * 1000 == pytest.approx(8.0)
