"""Greedy output of our model runner equals Hugging Face transformers, for every way a step can be
scheduled."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.loader import load_model
from engine.model import Model, kv_pool_shape
from engine.model_runner import ModelRunner, StepInput
from tests.tiny_models import ARCHS, MOE_ARCHS, hf_greedy, hf_logits, write_tiny_model

NEW_TOKENS = 12


# Mixtral's experts are Qwen3-MoE's but for their names: its greedy ids are checked through the
# server in the default suite (tests/server/test_routes_vs_hf.py), here in the second.
@pytest.fixture(
    scope="module",
    params=[
        *ARCHS,
        *(pytest.param(a, marks=pytest.mark.slow) if a == "mixtral" else a for a in MOE_ARCHS),
    ],
)
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Model]:
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    model, _ = load_model(folder)
    return folder, model


def random_ids(n: int, seed: int, vocab_size: int = 320) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


@dataclass
class Seq:
    tokens: list[int]  # everything so far; the KV of tokens[:cached] is in the pool
    cached: int = 0
    block_table: list[int] = field(default_factory=list)


class Engine:
    """A minimal scheduler for tests: shuffled free blocks, so tables are never contiguous."""

    def __init__(
        self,
        model: Model,
        block_size: int = 16,
        num_blocks: int = 96,
        device: str = "cpu",
        backend: str = "torch",
    ) -> None:
        # NaN in unwritten slots makes any read of KV that was never written poison the output.
        pool = torch.full(
            kv_pool_shape(model.cfg, num_blocks, block_size),
            float("nan"),
            dtype=model.dtype,
            device=device,
        )
        self.runner = ModelRunner(model, pool, block_size, backend)
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(block_size).shuffle(self.free)

    def input_for(self, seq: Seq, max_tokens: int | None = None) -> StepInput:
        end = (
            len(seq.tokens) if max_tokens is None else min(len(seq.tokens), seq.cached + max_tokens)
        )
        while len(seq.block_table) * self.block_size < end:
            seq.block_table.append(self.free.pop())
        inp = StepInput(
            seq.tokens[seq.cached : end],
            seq.cached,
            list(seq.block_table),
            sample=end == len(seq.tokens),
        )
        seq.cached = end
        return inp

    def run(self, seqs: list[Seq], inputs: list[StepInput]) -> torch.Tensor:
        """One forward; each sequence whose input samples gets its greedy next token appended."""
        logits = self.runner.forward(inputs)
        sampled = [s for s, inp in zip(seqs, inputs) if inp.sample]
        assert (
            logits.shape == (len(sampled), self.runner.model.cfg.vocab_size)
            and logits.dtype == torch.float32
        )
        for seq, row in zip(sampled, logits):
            seq.tokens.append(int(row.argmax()))
        return logits

    def step(self, seqs: list[Seq], max_tokens: int | None = None) -> torch.Tensor:
        return self.run(seqs, [self.input_for(s, max_tokens) for s in seqs])

    def generate(self, seq: Seq, n: int) -> list[int]:
        """Compute seq's uncached tokens, then decode until n new tokens; returns them."""
        start = len(seq.tokens)
        while len(seq.tokens) < start + n:
            self.step([seq])
        return seq.tokens[start:]


# Over a minute of CPU on 2 cores, in many tests: started first (tests/conftest.py).
RUN_FIRST = True

# The Triton backend runs its kernels here in Triton's interpreter (tests/conftest.py), the GPU's
# code path.
BACKENDS = pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
# Through Triton in the default suite: llama, mistral (its sliding window) and qwen3_moe's turn 1
# (per-head q/k norm, the MoE layer, whose kernels tests/engine/kernels/test_moe.py also checks
# against float64); the other architectures' layers run the same kernels, in the second, and so do
# qwen3_moe's append and mixed batch (25 s of Triton's interpreter on 2 cores).
SLOW_CASES = [
    *({"tiny": a, "backend": "triton"} for a in ("qwen2", "qwen3", "olmoe")),
    *({"tiny": "qwen3_moe", "backend": "triton", "block_size": b} for b in (8, 16)),
]


@BACKENDS
def test_turn1_prefill_then_decode_matches_hf(tiny: tuple[Path, Model], backend: str) -> None:
    folder, model = tiny
    prompt = random_ids(23, seed=1)
    engine, seq = Engine(model, backend=backend), Seq(list(prompt))
    logits = [engine.step([seq])[0]]
    while len(seq.tokens) < len(prompt) + NEW_TOKENS:
        logits.append(engine.step([seq])[0])
    out = seq.tokens[len(prompt) :]
    assert out == hf_greedy(folder, prompt, NEW_TOKENS)
    # Beyond the argmax: the logits themselves agree at every generated position.
    ref = hf_logits(folder, seq.tokens[:-1])[len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(logits), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("block_size", "backend"), [(16, "torch"), (8, "torch"), (8, "cpu"), (8, "triton")]
)
def test_turn2_append_prefill_over_cached_prefix_matches_hf(
    tiny: tuple[Path, Model], block_size: int, backend: str
) -> None:
    folder, model = tiny
    prompt = random_ids(21, seed=2)
    engine, seq = Engine(model, block_size, backend=backend), Seq(list(prompt))
    answer = engine.generate(seq, NEW_TOKENS)
    user2 = random_ids(17, seed=3)
    seq.tokens += user2
    append = engine.input_for(seq)
    # The last answer token and the new user turn go on top of the prompt+answer KV already in the
    # pool.
    assert (
        append.start_pos == len(prompt) + len(answer) - 1
        and len(append.token_ids) == len(user2) + 1
    )
    engine.run([seq], [append])
    out = engine.generate(seq, NEW_TOKENS - 1)
    assert [seq.tokens[len(prompt) + len(answer) + len(user2)]] + out == hf_greedy(
        folder, prompt + answer + user2, NEW_TOKENS
    )


def test_chunked_prefill_equals_unchunked_and_hf(tiny: tuple[Path, Model]) -> None:
    folder, model = tiny
    prompt = random_ids(45, seed=4)
    engine = Engine(model)
    whole, chunked = Seq(list(prompt)), Seq(list(prompt))
    whole_logits = engine.step([whole])
    while chunked.cached < len(prompt):
        chunk_logits = engine.step([chunked], max_tokens=16)
    torch.testing.assert_close(chunk_logits, whole_logits, atol=1e-5, rtol=1e-5)
    ref = hf_greedy(folder, prompt, NEW_TOKENS)
    assert engine.generate(chunked, NEW_TOKENS - 1) == ref[1:]
    assert engine.generate(whole, NEW_TOKENS - 1) == ref[1:]


def test_non_final_chunk_returns_no_logits(tiny: tuple[Path, Model]) -> None:
    _, model = tiny
    engine, seq = Engine(model), Seq(random_ids(30, seed=5))
    logits = engine.step([seq], max_tokens=10)
    assert logits.shape == (0, model.cfg.vocab_size) and len(seq.tokens) == 30


@pytest.mark.parametrize(
    ("block_size", "backend"),
    [(4, "torch"), (16, "torch"), (4, "cpu"), (16, "cpu"), (16, "triton")],
)
def test_mixed_batch_decode_prefill_and_append_prefill_match_hf(
    tiny: tuple[Path, Model], block_size: int, backend: str
) -> None:
    folder, model = tiny
    engine = Engine(model, block_size, backend=backend)
    a_prompt, b_prompt, c_prompt, c_user2 = (
        random_ids(n, seed=s) for n, s in ((19, 6), (33, 7), (12, 8), (9, 9))
    )
    a, b, c = Seq(list(a_prompt)), Seq(list(b_prompt)), Seq(list(c_prompt))
    # a and c prefill together and decode a few steps, so their blocks interleave.
    engine.step([a, c])
    for _ in range(4):
        engine.step([a, c])
    c_turn2 = c.tokens + c_user2
    c.tokens = list(c_turn2)
    inputs = [engine.input_for(a), engine.input_for(b), engine.input_for(c)]
    kinds = [(len(i.token_ids) > 1, i.start_pos > 0) for i in inputs]
    assert kinds == [(False, True), (True, False), (True, True)], (
        "decode, full prefill, append-prefill"
    )
    engine.run([a, b, c], inputs)
    for _ in range(NEW_TOKENS - 1):
        engine.step([a, b, c])
    assert a.tokens[len(a_prompt) :] == hf_greedy(folder, a_prompt, len(a.tokens) - len(a_prompt))
    assert b.tokens[len(b_prompt) :] == hf_greedy(folder, b_prompt, NEW_TOKENS)
    assert c.tokens[len(c_turn2) :] == hf_greedy(folder, c_turn2, NEW_TOKENS)


@pytest.mark.gpu
def test_turn1_on_cuda_matches_hf(tiny: tuple[Path, Model]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder, _ = tiny
    model, _ = load_model(folder, device="cuda")
    prompt = random_ids(23, seed=1)
    engine, seq = Engine(model, device="cuda"), Seq(list(prompt))
    assert engine.generate(seq, NEW_TOKENS) == hf_greedy(folder, prompt, NEW_TOKENS)
