"""Penalties, logit_bias, min_p and logprobs in the sampler, against transformers' logits processors
where it has them and OpenAI's documented formula where it does not (frequency and presence
penalties)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine.sampler import NO_LOGPROB, Row, Sampler
from engine.sampling_params import MAX_LOGPROBS, SamplingParams

VOCAB = 64
EOS = (2,)


def history(seed: int, num_prompt: int, num_output: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(num_prompt + num_output)]


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return 3.0 * torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed))


def check_logprobs(sampled_lp, expected: torch.Tensor, token: int, k: int) -> None:
    """sampled_lp reports the log-softmax of `expected` (processed logits): the token's, its rank,
    the top k."""
    lp = expected.log_softmax(-1)
    assert sampled_lp.logprob == pytest.approx(float(lp[token]), abs=1e-4)
    assert sampled_lp.rank == int((lp > lp[token]).sum()) + 1
    top = lp.topk(k)
    assert sampled_lp.top_ids == top.indices.tolist()
    assert sampled_lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_over_prompt_and_output(penalty: float) -> None:
    logits = logits_for(4, seed=1)
    rows = [
        Row(
            SamplingParams(temperature=0.0, repetition_penalty=penalty, logprobs=5),
            history(i, 10, 3 * i),
            10,
            f"r{i}",
        )
        for i in range(4)
    ]
    sampled = Sampler(EOS)(logits.clone(), rows)
    for i, row in enumerate(rows):
        ids = torch.tensor([list(row.token_ids)])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())[0]
        assert sampled.tokens[i] == int(expected.argmax())
        check_logprobs(sampled.logprobs[i], expected, sampled.tokens[i], 5)


def test_frequency_and_presence_penalties_follow_openai_over_the_output_only() -> None:
    logits = logits_for(3, seed=2)
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=f, presence_penalty=p, logprobs=3)
        for f, p in ((0.5, 0.0), (0.0, 1.5), (-0.7, 0.9))
    ]
    rows = [Row(p, history(i, 8, 12), 8, f"r{i}") for i, p in enumerate(params)]
    sampled = Sampler(EOS)(logits.clone(), rows)
    for i, (row, p) in enumerate(zip(rows, params)):
        counts = torch.bincount(torch.tensor(row.token_ids[8:]), minlength=VOCAB).float()
        # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence; prompt tokens
        # do not count.
        expected = (
            logits[i] - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
        )
        assert sampled.tokens[i] == int(expected.argmax())
        check_logprobs(sampled.logprobs[i], expected, sampled.tokens[i], 3)


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = logits_for(2, seed=3)
    bias = ((5, 8.0), (9, -100.0), (int(logits[1].argmax()), -5.0))
    rows = [
        Row(SamplingParams(temperature=0.0, logit_bias=bias, logprobs=4), [1, 2, 3], 3, f"r{i}")
        for i in range(2)
    ]
    sampled = Sampler(EOS)(logits.clone(), rows)
    processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})
    for i in range(2):
        expected = processor(torch.tensor([[1, 2, 3]]), logits[i : i + 1].clone())[0]
        assert sampled.tokens[i] == int(expected.argmax())
        check_logprobs(sampled.logprobs[i], expected, sampled.tokens[i], 4)


def test_min_p_draws_only_what_transformers_keeps() -> None:
    logits = logits_for(1, seed=4)[0]
    kept = MinPLogitsWarper(0.1)(torch.tensor([[0]]), logits[None].clone())[0] > float("-inf")
    sampler = Sampler(EOS)
    params = [SamplingParams(temperature=1.0, min_p=0.1, seed=s) for s in range(300)]
    tokens = sampler(
        logits.expand(300, VOCAB).clone(), [Row(p, request_id=str(i)) for i, p in enumerate(params)]
    ).tokens
    assert set(tokens) == set(kept.nonzero().flatten().tolist())  # all of them, and nothing else


def test_token_counts_follow_a_growing_history_and_a_recomputed_one() -> None:
    """Step by step the counts are updated with the new tokens only; the result equals a fresh
    sampler's."""
    p = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.5,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logprobs=2,
    )
    tokens = history(7, 6, 0)
    sampler = Sampler(EOS)
    for step in range(12):
        logits = logits_for(1, seed=100 + step)
        got = sampler(logits.clone(), [Row(p, list(tokens), 6, "a")])
        fresh = Sampler(EOS)(logits.clone(), [Row(p, list(tokens), 6, "a")])
        assert got.tokens == fresh.tokens and got.logprobs == fresh.logprobs
        tokens.append(got.tokens[0])
    # The same id with a shorter history (recomputed after preemption elsewhere) is counted from
    # scratch.
    logits = logits_for(1, seed=999)
    assert (
        sampler(logits.clone(), [Row(p, tokens[:8], 6, "a")]).logprobs
        == Sampler(EOS)(logits.clone(), [Row(p, tokens[:8], 6, "a")]).logprobs
    )
    sampler.release("a")
    assert not sampler._counts[torch.device("cpu")].slots


def test_logprobs_of_excluded_tokens_are_finite_and_last() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS[0]] = 50.0  # the favourite, but banned before min_tokens
    p = SamplingParams(temperature=0.0, min_tokens=4, logprobs=MAX_LOGPROBS)
    sampled = Sampler(EOS)(logits, [Row(p)])
    lp = sampled.logprobs[0]
    assert sampled.tokens[0] != EOS[0] and EOS[0] not in lp.top_ids
    assert len(lp.top_ids) == MAX_LOGPROBS and lp.rank == 1
    logits[0, 1:] = float(
        "-inf"
    )  # only token 0 allowed: every alternative reports the floor, not -inf
    lp = Sampler(EOS)(logits, [Row(SamplingParams(temperature=0.0, logprobs=3))]).logprobs[0]
    assert lp.logprob == pytest.approx(0.0) and lp.top_logprobs[1:] == [NO_LOGPROB, NO_LOGPROB]


def test_logprobs_are_per_row_and_do_not_change_the_draw() -> None:
    logits = logits_for(6, seed=5)
    params = [
        SamplingParams(temperature=0.9, top_k=10, seed=i, logprobs=[None, 0, 3][i % 3])
        for i in range(6)
    ]
    with_lp = Sampler(EOS)(
        logits.clone(), [Row(p, request_id=str(i)) for i, p in enumerate(params)]
    )
    plain = [SamplingParams(temperature=0.9, top_k=10, seed=i) for i in range(6)]
    without = Sampler(EOS)(logits.clone(), [Row(p, request_id=str(i)) for i, p in enumerate(plain)])
    assert with_lp.tokens == without.tokens
    assert [lp is None for lp in with_lp.logprobs] == [True, False, False] * 2
    assert [len(lp.top_ids) for lp in with_lp.logprobs if lp is not None] == [0, 3, 0, 3]
    for i in (
        1,
        2,
        4,
        5,
    ):  # the unscaled distribution: temperature and top-k narrow the draw, not the report
        check_logprobs(with_lp.logprobs[i], logits[i], with_lp.tokens[i], params[i].logprobs)
