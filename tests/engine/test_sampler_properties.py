"""The sampler under arbitrary valid parameters (hypothesis): a token id inside the vocabulary for
every row, never an end token before min_tokens, argmax for greedy rows, the same token for a seeded
row whatever its batch, logprobs where asked (finite, the token's rank, as many alternatives as
asked)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.engine.rows import draw
from tests.engine.rows import rows as make_rows

VOCAB = 48
EOS = (2, 7)

params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.01, 2.0)),
    top_p=st.one_of(st.just(1.0), st.floats(0.001, 1.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 2 * VOCAB)),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    max_tokens=st.just(64),
    min_tokens=st.integers(0, 8),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB // 2, unique=True).map(tuple),
    ignore_eos=st.booleans(),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    presence_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    frequency_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.01, 100.0)),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0), max_size=4).map(
        lambda d: tuple(d.items())
    ),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.tuples(params, st.integers(0, 10)), min_size=1, max_size=6),
    logits_seed=st.integers(0, 2**31),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_any_valid_parameters_give_a_token_that_obeys_them(rows, logits_seed, scale) -> None:
    ps, indices = [p for p, _ in rows], [i for _, i in rows]
    logits = scale * torch.randn(
        len(rows), VOCAB, generator=torch.Generator().manual_seed(logits_seed)
    )
    sampler = Sampler(EOS)
    sampled = sampler(logits.clone(), make_rows(ps, indices))
    tokens = sampled.tokens
    assert len(tokens) == len(rows)
    for row, (p, index, token) in enumerate(zip(ps, indices, tokens, strict=True)):
        assert 0 <= token < VOCAB
        assert p.problem(VOCAB) is None
        lp = sampled.logprobs[row]
        assert (lp is None) == (p.logprobs is None)
        if lp is not None:
            assert len(lp.top_ids) == len(lp.top_logprobs) == p.logprobs
            assert (
                all(math.isfinite(x) for x in (lp.logprob, *lp.top_logprobs)) and lp.logprob <= 0.0
            )
            assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
            assert (lp.rank <= p.logprobs) == (token in lp.top_ids) or lp.logprob in lp.top_logprobs
        banned = set(EOS) | set(p.stop_token_ids) if index < p.min_tokens else set()
        assert token not in banned
        if p.greedy and not (p.penalized or p.logit_bias):
            allowed = logits[row].clone()
            allowed[list(banned)] = float("-inf")
            assert token == int(allowed.argmax())
        if p.seed is not None:  # alone, in a fresh sampler: the same token
            assert draw(Sampler(EOS), logits[row : row + 1].clone(), [p], [index]) == [token]


def test_stop_ids_past_the_vocabulary_are_ignored_not_fatal() -> None:
    # The API refuses them; a worker that receives one anyway must not fail (it did: index out of
    # range).
    logits = torch.randn(2, VOCAB)
    logits[:, EOS[0]] = 100.0  # the favourite, unless banned
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(VOCAB, VOCAB + 1000))
    banned = logits[0].clone()
    banned[list(EOS)] = float("-inf")
    assert draw(Sampler(EOS), logits, [p, p], [0, 5]) == [int(banned.argmax()), EOS[0]]
