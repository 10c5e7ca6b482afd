"""Steps through the captured-graph path: static buffers refilled in place, padding, buckets.

On the CPU the graph replay is stood in by running the captured step eagerly on the same static
buffers (Triton's interpreter), which checks everything the engine adds around a graph: the buffers,
the padding of sequences and tokens, the static index of sampled rows, the per-bucket tiles and
split-KV workspace. On a GPU the real graphs are captured and replayed
(tests/engine/test_engine.py).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.attention import triton_backend
from engine.attention.base import GraphBucket
from engine.cuda_graphs import (
    MAX_GRAPH_TOKENS,
    StepGraphs,
    bucket_sizes,
    graph_buckets,
    token_bucket_sizes,
)
from engine.loader import load_model
from engine.model import kv_pool_shape
from engine.model_runner import ModelRunner, PromptLogprobsAsk, StepInput
from tests.tiny_models import ARCHS, hf_greedy, write_tiny_model

BLOCK = 16


def test_buckets() -> None:
    assert bucket_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(1000)[-1] == 512  # the largest captured batch
    assert token_bucket_sizes(512) == [16] + list(range(32, 257, 32)) + [320, 384, 448, 512]
    assert token_bucket_sizes(100) == [16, 32, 64, 96, 100]
    assert token_bucket_sizes(0) == []
    assert token_bucket_sizes(4096)[-1] == MAX_GRAPH_TOKENS
    buckets = graph_buckets(8, 64)
    assert [b for b in buckets if b.decode] == [GraphBucket(n, n, True) for n in (1, 2, 4, 8)]
    # A token bucket holds up to max_batch sequences (never more than its tokens).
    assert [(b.tokens, b.seqs) for b in buckets if not b.decode] == [(16, 8), (32, 8), (64, 8)]
    assert not any(b.decode for b in graph_buckets(8, 64, decode=False))


class EagerReplay:
    """Stands in for a captured torch.cuda.CUDAGraph on the CPU: replay runs the captured step
    eagerly."""

    def __init__(self, graphs: StepGraphs, bucket: GraphBucket) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs.forward(self.bucket)


def eager_graphs(runner: ModelRunner, max_batch: int, max_tokens: int = 64) -> StepGraphs:
    graphs = StepGraphs(runner.model, runner.backend, max_batch, max_tokens)
    graphs.graphs = {bucket: EagerReplay(graphs, bucket) for bucket in graphs.buckets}
    return graphs


class Seqs:
    """Sequences that grow by the steps given them, over blocks taken in a shuffled order from a
    shared list."""

    def __init__(self, prompts: list[list[int]], free: list[int]) -> None:
        self.tokens = [list(p) for p in prompts]
        self.cached = [0] * len(prompts)
        self.tables: list[list[int]] = [[] for _ in prompts]
        self.free = free

    def inputs(self, which: list[int], new: dict[int, list[int]] | None = None) -> list[StepInput]:
        """A step of sequences `which`: each its uncached tokens, after appending new[i] to sequence
        i."""
        inputs = []
        for i in which:
            self.tokens[i] += (new or {}).get(i, [])
            end = len(self.tokens[i])
            while len(self.tables[i]) * BLOCK < end:
                self.tables[i].append(self.free.pop())
            inputs.append(
                StepInput(
                    self.tokens[i][self.cached[i] : end], self.cached[i], list(self.tables[i])
                )
            )
            self.cached[i] = end
        return inputs


# The four architectures, two with each mixed launch (MIXED_LAUNCH), and llama with 1,024 positions,
# whose token buckets split their keys.
# mistral's runs here (its sliding window, the sequential launch); llama's, qwen2's, qwen3's and
# llama-1024's (the fused launch, 20-80 s each on 2 cores) in the second suite.
STATIC_CASES = {arch: (arch, 256, ("fused", "sequential")[i % 2]) for i, arch in enumerate(ARCHS)}
STATIC_CASES["llama-1024"] = ("llama", 1024, "fused")
SLOW_STATIC = {"llama", "qwen2", "qwen3", "llama-1024"}


@pytest.mark.parametrize(
    ("arch", "positions", "mixed"),
    [
        pytest.param(*case, id=name, marks=[pytest.mark.slow] if name in SLOW_STATIC else [])
        for name, case in STATIC_CASES.items()
    ],
)
def test_padded_static_path_equals_the_eager_one(
    arch: str, positions: int, mixed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode-only, append-only and mixed steps through the padded static path give the eager path's
    logits and greedy ids, and write exactly the same KV (padding tokens write none: both pools
    start as NaN). With 1,024 positions the token buckets are planned to split their general grid's
    keys 4 ways (the eager steps, over short contexts, do not): the splits past a short sequence's
    keys are empty."""
    monkeypatch.setattr(triton_backend, "MIXED_LAUNCH", mixed)
    folder = write_tiny_model(tmp_path, arch, max_position_embeddings=positions)
    runners = []
    for graphs in (False, True):
        model, cfg = load_model(folder)
        runner = ModelRunner(
            model, torch.full(kv_pool_shape(cfg, 64, BLOCK), float("nan")), BLOCK, "triton"
        )
        runner.graphs = eager_graphs(runner, max_batch=8, max_tokens=64) if graphs else None
        runners.append(runner)
    eager, static = runners
    token_splits = {b.tokens: n for b, n in static.graphs.static.splits.items() if not b.decode}
    assert token_splits == ({16: 4, 32: 4, 64: 4} if positions == 1024 else {16: 1, 32: 1, 64: 1})
    rng = random.Random(0)
    free = list(range(64))
    rng.shuffle(free)
    seqs = Seqs([[rng.randrange(3, 320) for _ in range(n)] for n in (21, 7, 30, 12)], free)
    used: list[str] = []

    def step(inputs: list[StepInput]) -> list[int]:
        batch = static.make_batch(inputs)
        bucket = static.graphs.bucket_for(batch)
        assert bucket is not None, "every step of this test fits a bucket"
        used.append(f"{'decode' if bucket.decode else 'tokens'} {bucket.tokens}")
        want, got = eager.forward(inputs), static.forward(inputs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ids = want.argmax(-1).tolist()
        assert got.argmax(-1).tolist() == ids
        return ids

    def greedy(which: list[int], ids: list[int]) -> dict[int, list[int]]:
        return {i: [t] for i, t in zip(which, ids)}

    first = step(
        seqs.inputs([0, 1, 2])
    )  # three prompts: 58 tokens, bucket 64 with one padding sequence
    nxt = greedy([0, 1, 2], first)
    for _ in range(2):  # decode-only: three sequences in bucket 4, one padding row
        nxt = greedy([0, 1, 2], step(seqs.inputs([0, 1, 2], nxt)))
    # Append-only: two turns add 9 and 14 new tokens over their cached history (bucket 32).
    appends = {
        0: nxt[0] + [rng.randrange(3, 320) for _ in range(8)],
        2: nxt[2] + [rng.randrange(3, 320) for _ in range(13)],
    }
    after = greedy([0, 2], step(seqs.inputs([0, 2], appends)))
    # Mixed: sequence 1 decodes, 0 and 2 decode after their appends, 3 is a new prompt (bucket 16
    # then 16).
    mixed = step(
        seqs.inputs([3, 1, 0, 2], {1: nxt[1], **after})
    )  # the prompt first: decodes are moved ahead
    nxt = greedy([3, 1, 0, 2], mixed)
    last = step(seqs.inputs([3, 1, 0, 2], nxt))  # four decodes: bucket 4, no padding
    # Async scheduling: the next tokens are taken on the device from the step before's samples (here
    # in another order than the step's), on the static path of a decode step and of a step beside a
    # new prompt.
    sampled = torch.tensor(last)
    inputs = seqs.inputs([3, 1, 0, 2], greedy([3, 1, 0, 2], last))
    ahead = [replace(inp, token_ids=[0], previous=k) for k, inp in enumerate(inputs)]
    torch.testing.assert_close(
        static.forward(ahead[::-1], sampled), eager.forward(inputs[::-1]), rtol=1e-5, atol=1e-5
    )
    seqs.cached = [
        n - 1 for n in seqs.cached
    ]  # the same step again, beside a new prompt (writing the same KV)
    inputs = seqs.inputs([3, 1, 0, 2])
    ahead = [replace(inp, token_ids=[0], previous=k) for k, inp in enumerate(inputs)]
    prompt = StepInput([rng.randrange(3, 320) for _ in range(5)], 0, [seqs.free.pop()])
    torch.testing.assert_close(
        static.forward([prompt, *ahead], sampled),
        eager.forward([prompt, *inputs]),
        rtol=1e-5,
        atol=1e-5,
    )
    assert used == ["tokens 64", "decode 4", "decode 4", "tokens 32", "tokens 16", "decode 4"]
    torch.testing.assert_close(static.kv_pool, eager.kv_pool, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_logits_come_out_in_input_order_whatever_the_kinds_order(
    tiny_llama: Path, backend: str
) -> None:
    """A step's decodes run ahead of its other sequences (attention's two grids), but its logits are
    in input order: a decode after a prompt gets the same logits as before it."""
    logits = []
    for order in ([0, 1, 2], [1, 2, 0]):
        model, cfg = load_model(tiny_llama)
        runner = ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 16, BLOCK)), BLOCK, backend)
        runner.forward([StepInput(list(range(10, 30)), 0, [0, 1])])  # the decode's context
        inputs = [
            StepInput([7], 20, [0, 1]),
            StepInput(list(range(40, 57)), 0, [2, 3]),
            StepInput(list(range(60, 66)), 0, [4], sample=False),
        ]
        batch = runner.make_batch([inputs[i] for i in order])
        assert batch.num_decodes == 1 and batch.query_start[:2] == [0, 1]
        rows = runner.forward([inputs[i] for i in order])
        logits.append(rows if order == [0, 1, 2] else rows[[1, 0]])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_steps_that_fit_no_bucket_run_eagerly(tiny_llama: Path) -> None:
    model, cfg = load_model(tiny_llama)
    runner = ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 32, BLOCK)), BLOCK, "triton")
    graphs = eager_graphs(runner, max_batch=4, max_tokens=32)

    def bucket(*inputs: StepInput) -> GraphBucket | None:
        return graphs.bucket_for(runner.make_batch(list(inputs)))

    one = StepInput([5], 3, [0])
    assert bucket(one, one) == GraphBucket(2, 2, True)
    assert bucket(*[one] * 5) is None  # more sequences than max_batch
    assert bucket(StepInput([5] * 33, 0, [0, 1, 2])) is None  # more tokens than max_tokens
    assert bucket(StepInput([5] * 32, 0, [0, 1])) == GraphBucket(32, 4, False)
    assert bucket(StepInput([5] * 3, 0, [0]), one) == GraphBucket(16, 4, False)
    assert bucket(StepInput([5], 3, [0], sample=False)) == GraphBucket(
        16, 4, False
    )  # a chunk that samples nothing
    asks = StepInput([5] * 3, 0, [0], prompt_logprobs=PromptLogprobsAsk([5, 5], 1))
    assert bucket(asks) is None  # prompt logprobs keep hidden states: eager


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 1024 positions: enough that a graph bucket of one sequence splits its KV (see
    # choose_num_splits).
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=1024)


# Over 30 s on 2 cores; the default suite's llama-1024 case above checks the same split buckets
# against the eager path, which the model tests check against transformers.
@pytest.mark.slow
def test_decode_through_static_buffers_matches_hf(long_llama: Path) -> None:
    model, cfg = load_model(long_llama)
    pool = torch.full(kv_pool_shape(cfg, 160, BLOCK), float("nan"))
    runner = ModelRunner(model, pool, BLOCK, "triton")
    graphs = eager_graphs(runner, max_batch=4, max_tokens=0)
    assert graphs.static.splits[GraphBucket(1, 1, True)] > 1, (
        "the one-sequence bucket should split its KV"
    )
    free = list(range(160))
    random.Random(0).shuffle(free)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (300, 40, 75)]
    seqs = Seqs(prompts, free)

    def step(which: list[int]) -> None:
        inputs = seqs.inputs(which)
        batch = runner.make_batch(inputs)
        runner.graphs = (
            graphs if batch.is_decode else None
        )  # no token buckets here: prefills run eagerly
        logits = runner.forward(inputs)
        for i, row in zip(which, logits):
            seqs.tokens[i].append(int(row.argmax()))

    step([0, 1, 2])  # prefill all three
    step([0])  # one sequence: bucket 1, split KV
    for _ in range(5):
        step([0, 1, 2])  # three sequences: bucket 4 with one padding row
    for tokens, p in zip(seqs.tokens, prompts):
        n = len(tokens) - len(p)
        assert tokens[len(p) :] == hf_greedy(long_llama, p, n)


def test_one_graph_set_per_split_stream_captured_on_that_stream(
    long_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Green-context splits: capture_graphs captures a set per stream (keyed as use_graphs takes
    them), each on its own stream, with every bucket, its decode KV splits sized for its SMs, all
    in one memory pool and with one set of static inputs and outputs; a later call adds sets;
    use_graphs picks the set a step replays."""
    model, cfg = load_model(long_llama)
    runner = ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 8, 16)), 16, "triton")
    captured = []

    def capture(self: StepGraphs, stream=None, pool=None, label: str = ""):
        captured.append((stream, pool))
        for bucket in self.buckets:
            self.graphs[bucket] = f"graph {bucket.tokens} on {stream}"
        return pool or "the pool"

    monkeypatch.setattr(StepGraphs, "capture", capture)
    # The model's 2 KV heads and 1,024 positions: one sequence splits its keys in 4 on 64 SMs or
    # more, in 2 on 2 SMs, not at all on 1.
    streams = {-1: "whole", 0: "decode on 2 SMs", 1: "decode on 64 SMs"}
    runner.capture_graphs(20, streams, sms={0: 2, 1: 64}, max_tokens=64)
    runner.capture_graphs(20, {2: "decode on 1 SM"}, sms={2: 1}, max_tokens=64)
    assert captured == [
        ("whole", None),
        ("decode on 2 SMs", "the pool"),
        ("decode on 64 SMs", "the pool"),
        ("decode on 1 SM", "the pool"),
    ]
    one = GraphBucket(1, 1, True)
    assert {key: runner.graph_sets[key].static.splits[one] for key in (-1, 0, 1, 2)} == {
        -1: 4,
        0: 2,
        1: 4,
        2: 1,
    }
    for key, stream in {**streams, 2: "decode on 1 SM"}.items():
        graphs = runner.graph_sets[key]
        assert (
            graphs.buckets == graph_buckets(20, 64) and graphs.graphs[one] == f"graph 1 on {stream}"
        )
        assert graphs.io is runner.graph_sets[-1].io
    assert runner.graphs is runner.graph_sets[-1]
    runner.use_graphs(1)
    assert runner.graphs is runner.graph_sets[1]


@pytest.fixture
def blas_settings(monkeypatch: pytest.MonkeyPatch) -> dict:
    """torch's carveout and preferred BLAS library, stood in (the CPU's torch cannot choose
    cuBLASLt), on a device of 132 SMs."""
    state = {"carveout": None, "library": "cublas"}

    def library(backend=None):
        state["library"] = state["library"] if backend is None else backend
        return state["library"]

    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: state["carveout"])
    monkeypatch.setattr(
        torch._C, "_set_sm_carveout_experimental", lambda n: state.update(carveout=n)
    )
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", library)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(multi_processor_count=132),
    )
    return state


def test_with_the_sm_target_each_set_is_captured_under_its_splits_carveout_then_put_back(
    long_llama: Path, monkeypatch: pytest.MonkeyPatch, blas_settings: dict
) -> None:
    """--cublas-sm-target: a split's set is captured through cuBLASLt with the carveout 132 - its
    SMs, the whole device's with 0, and the settings before are restored after each set, also
    when a capture fails; without it nothing is set."""
    model, cfg = load_model(long_llama)
    runner = ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 8, 16)), 16, "triton")
    seen = []

    def capture(self: StepGraphs, stream=None, pool=None, label: str = ""):
        seen.append((stream, blas_settings["carveout"], blas_settings["library"], label))
        if stream == "broken":
            raise RuntimeError("capture failed")
        return "the pool"

    monkeypatch.setattr(StepGraphs, "capture", capture)
    streams = {-1: "whole", 0: "decode on 96 SMs", 1: "decode on 64 SMs"}
    runner.capture_graphs(20, streams, sms={-1: 132, 0: 96, 1: 64}, max_tokens=64, sm_target=True)
    assert [s[:3] for s in seen] == [
        ("whole", 0, "cublaslt"),
        ("decode on 96 SMs", 36, "cublaslt"),
        ("decode on 64 SMs", 68, "cublaslt"),
    ]
    assert "cuBLASLt SM target 64" in seen[-1][3]
    assert blas_settings == {"carveout": None, "library": "cublas"}
    seen.clear()
    runner.capture_graphs(20, {2: "decode on 32 SMs"}, sms={2: 32}, max_tokens=64)
    assert seen == [("decode on 32 SMs", None, "cublas", ", stream 2")]
    with pytest.raises(RuntimeError, match="capture failed"):
        runner.capture_graphs(20, {3: "broken"}, sms={3: 32}, max_tokens=64, sm_target=True)
    assert blas_settings == {"carveout": None, "library": "cublas"}


def test_sm_target_sections_of_two_threads_never_overlap(blas_settings: dict) -> None:
    """The prefill thread captures while the decode thread may: each section sets, captures and
    restores alone."""
    import threading
    import time

    from engine.cuda_graphs import cublas_sm_target

    events = []

    def section(carveout: int) -> None:
        with cublas_sm_target(carveout):
            events.append(("in", carveout, blas_settings["carveout"]))
            time.sleep(0.05)
            events.append(("out", carveout, blas_settings["carveout"]))

    threads = [threading.Thread(target=section, args=(n,)) for n in (36, 68)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e[0] for e in events] == ["in", "out", "in", "out"]
    assert all(carveout == seen for _, carveout, seen in events)
    assert blas_settings == {"carveout": None, "library": "cublas"}
