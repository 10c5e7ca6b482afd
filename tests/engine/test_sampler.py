"""Sampler: greedy, top-k/top-p cuts, temperature, seeded reproducibility, min_tokens."""

from __future__ import annotations

import random
import subprocess
import sys

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.engine.rows import draw

EOS = (2, 5)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(0))
    assert draw(Sampler(EOS), logits, [greedy()] * 32, [0] * 32) == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=1.5, top_k=1, seed=i if i % 2 else None) for i in range(32)
    ]
    assert draw(Sampler(EOS), logits, params, [0] * 32) == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(2))
    params = [greedy() if i % 2 else SamplingParams(temperature=1.0, top_p=0.9) for i in range(16)]
    tokens = draw(Sampler(EOS), logits, params, [0] * 16)
    assert tokens[1::2] == logits.argmax(-1).tolist()[1::2]


def test_seeded_tokens_independent_of_batch_order_and_sampler() -> None:
    vocab = 1000
    logits = (
        torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 0.1
    )  # near-uniform: any noise change shows
    targets = [
        (logits[0], SamplingParams(temperature=1.0, seed=7), 0),
        (logits[1], SamplingParams(temperature=0.8, top_p=0.95, seed=8), 3),
        (logits[2], SamplingParams(temperature=1.2, top_k=500, seed=9), 10),
    ]
    alone = [draw(Sampler(EOS), row[None], [p], [i])[0] for row, p, i in targets]
    others = [
        (logits[3], greedy(), 0),
        (logits[3], SamplingParams(temperature=0.5), 4),
        (logits[3], SamplingParams(temperature=1.0, top_k=3, seed=123), 1),
    ]
    rng = random.Random(0)
    sampler = Sampler(EOS)
    for _ in range(5):
        batch = list(enumerate(targets)) + [(None, o) for o in others]
        rng.shuffle(batch)
        rows = torch.stack([row for _, (row, _, _) in batch])
        tokens = draw(sampler, rows, [p for _, (_, p, _) in batch], [i for _, (_, _, i) in batch])
        got = {t: tok for (t, _), tok in zip(batch, tokens) if t is not None}
        assert [got[t] for t in range(len(targets))] == alone


def test_seeded_tokens_same_in_another_process() -> None:
    script = (
        "import torch; from engine.sampler import Sampler; from engine.sampling_params import "
        "SamplingParams as P;"
        "from tests.engine.rows import draw;"
        "g = torch.Generator().manual_seed(4); logits = torch.randn(3, 1000, generator=g) * 0.1;"
        "print(draw(Sampler([2]), logits, [P(seed=11), P(seed=12, top_p=0.9), P(seed=13, "
        "top_k=50)], [0, 5, 9]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(4)) * 0.1
    params = [
        SamplingParams(seed=11),
        SamplingParams(seed=12, top_p=0.9),
        SamplingParams(seed=13, top_k=50),
    ]
    draw(
        Sampler([2]), logits, [SamplingParams()] * 3, [0] * 3
    )  # move this process's shared generator on
    assert out.strip() == str(draw(Sampler([2]), logits, params, [0, 5, 9]))


def test_different_seeds_and_indices_differ() -> None:
    logits = torch.zeros(64, 1000)
    sampler = Sampler(EOS)
    a = draw(sampler, logits, [SamplingParams(seed=1)] * 64, list(range(64)))
    b = draw(sampler, logits, [SamplingParams(seed=2)] * 64, list(range(64)))
    # Uniform over 1000 tokens: equal draws at a position have chance 1/1000.
    assert sum(x != y for x, y in zip(a, b)) >= 60
    assert len(set(a)) >= 55  # a seed's noise changes with the output index
    # Neighbouring seeds are not one stream shifted: (seed 1, index i + 1) vs (seed 2, index i).
    assert sum(x != y for x, y in zip(a[1:], b[:-1])) >= 59


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=2.0, top_p=1e-3, seed=i if i % 2 else None) for i in range(64)
    ]
    assert draw(Sampler(EOS), logits, params, [0] * 64) == logits.argmax(-1).tolist()


def test_top_p_keeps_smallest_set_reaching_the_mass() -> None:
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log().repeat(400, 1)
    params = [SamplingParams(top_p=0.75, seed=s) for s in range(400)]
    # Sorted masses 0.5 (token 1), 0.3 (token 2), 0.2 (token 0): {1, 2} reaches 0.75, token 0 must
    # never come out.
    assert set(draw(Sampler(EOS), logits, params, [0] * 400)) == {1, 2}


def test_top_k_never_leaves_the_top_k() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(6)).repeat(600, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(EOS)
    only_k = draw(
        sampler,
        logits,
        [SamplingParams(temperature=3.0, top_k=5, seed=s) for s in range(600)],
        [0] * 600,
    )
    assert set(only_k) == top5
    with_p = draw(
        sampler,
        logits,
        [SamplingParams(temperature=3.0, top_k=5, top_p=0.99, seed=s) for s in range(600)],
        [0] * 600,
    )
    assert set(with_p) == top5
    # Rows without a cut in the same batch still reach beyond the top 5.
    mixed = [SamplingParams(temperature=3.0, top_k=5 if s % 2 else 0, seed=s) for s in range(600)]
    tokens = draw(sampler, logits, mixed, [0] * 600)
    assert set(tokens[1::2]) <= top5 and not set(tokens[0::2]) <= top5


def test_temperature_frequencies_match_softmax() -> None:
    n, temperature = 4000, 0.7
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    tokens = draw(
        Sampler(EOS),
        base.repeat(n, 1),
        [SamplingParams(temperature=temperature, seed=s) for s in range(n)],
        [0] * n,
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    expected = (base / temperature).softmax(-1).double()
    # 5 standard errors per token: a correct sampler fails with probability ~1e-6 (and the seeds are
    # fixed) ...
    tolerance = 5 * (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= tolerance).all(), (freq, expected)
    # ... while a mis-applied temperature (ignored, squared, or multiplied) lies far outside.
    for wrong in (1.0, temperature**2, 1 / temperature):
        assert ((base / wrong).softmax(-1).double() - expected).abs().gt(tolerance).any()


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.full((1, 12), -5.0)
    logits[0, [2, 5, 7, 9]] = torch.tensor([10.0, 9.0, 8.0, 7.0])
    original = logits.clone()
    sampler = Sampler(EOS)
    params = greedy(min_tokens=3, stop_token_ids=(7,))
    assert [draw(sampler, logits, [params], [i])[0] for i in range(5)] == [9, 9, 9, 2, 2]
    assert torch.equal(logits, original), "the caller's logits must not change"
    flat = torch.zeros(500, 12)
    sampled = draw(
        sampler,
        flat,
        [SamplingParams(min_tokens=1, stop_token_ids=(7,), seed=s) for s in range(500)],
        [0] * 500,
    )
    assert not set(sampled) & {2, 5, 7} and len(set(sampled)) == 9
    later = draw(
        sampler, flat, [SamplingParams(min_tokens=1, seed=s) for s in range(500)], [1] * 500
    )
    assert {2, 5} <= set(later)


def test_large_batch_stays_within_each_rows_top_k() -> None:
    logits = torch.randn(256, 4000, generator=torch.Generator().manual_seed(7))
    top50 = logits.topk(50, dim=-1).indices
    same = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50)] * 256
    mixed = [
        SamplingParams(temperature=0.5 + i / 256, top_p=0.9 + i / 5000, top_k=50, seed=i)
        for i in range(256)
    ]
    for params in (same, mixed):
        tokens = torch.tensor(draw(Sampler(EOS), logits, params, [0] * 256))
        assert (top50 == tokens[:, None]).any(dim=-1).all()


def test_a_server_seed_repeats_unseeded_requests_draws() -> None:
    """--seed: two samplers started with the same seed draw alike for requests without a seed of
    their own (a restarted server given the same traffic); unseeded samplers do not."""
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(5)) * 0.1
    params = [SamplingParams(temperature=1.0)] * 8

    def draws(sampler: Sampler) -> list[int]:
        return [t for _ in range(4) for t in draw(sampler, logits, params, [0] * 8)]

    assert draws(Sampler(EOS, seed=42)) == draws(Sampler(EOS, seed=42))
    assert draws(Sampler(EOS, seed=42)) != draws(Sampler(EOS, seed=43))
    assert draws(Sampler(EOS)) != draws(Sampler(EOS))
