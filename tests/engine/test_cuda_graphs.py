"""Decode steps through the captured-graph path: static buffers refilled in place, padding rows, buckets.

On the CPU the graph replay is stood in by running the captured forward eagerly on the same static buffers,
which checks everything the engine adds (the buffers, the padding, the per-bucket split-KV workspace); on a
GPU the real graphs are captured and replayed (tests/engine/test_engine.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs, bucket_sizes
from engine.loader import load_model
from engine.model import kv_pool_shape
from engine.model_runner import ModelRunner, StepInput
from tests.tiny_models import hf_greedy, write_tiny_model


def test_buckets() -> None:
    assert bucket_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(1000)[-1] == 512  # the largest captured batch


class EagerReplay:
    """Stands in for a captured torch.cuda.CUDAGraph on the CPU: replay recomputes into the output buffer."""

    def __init__(self, forward, out: torch.Tensor) -> None:
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


def eager_graphs(runner: ModelRunner, max_batch: int) -> DecodeGraphs:
    graphs = DecodeGraphs(runner.model, runner.backend, max_batch)
    for bs in graphs.sizes:
        meta = graphs.backend.graph_view(graphs.static, bs)
        out = torch.empty(bs, runner.model.cfg.vocab_size)
        graphs.graphs[bs] = (EagerReplay(lambda bs=bs, meta=meta: graphs._forward(bs, meta), out), out)
    return graphs


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 1024 positions: enough that a graph bucket of one sequence splits its KV (see choose_num_splits).
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=1024)


def test_decode_through_static_buffers_matches_hf(long_llama: Path) -> None:
    model, cfg = load_model(long_llama)
    block_size = 16
    pool = torch.full(kv_pool_shape(cfg, 160, block_size), float("nan"))
    runner = ModelRunner(model, pool, block_size, "triton")
    graphs = eager_graphs(runner, max_batch=4)
    assert graphs.static.splits[1] > 1, "the one-sequence bucket should split its KV"
    free = list(range(160))
    random.Random(0).shuffle(free)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (300, 40, 75)]
    seqs = [{"tokens": list(p), "cached": 0, "table": []} for p in prompts]

    def step(active: list[dict]) -> None:
        inputs = []
        for s in active:
            end = len(s["tokens"])
            while len(s["table"]) * block_size < end:
                s["table"].append(free.pop())
            inputs.append(StepInput(s["tokens"][s["cached"]:end], s["cached"], list(s["table"])))
            s["cached"] = end
        batch = runner.make_batch(inputs)
        runner.graphs = graphs if batch.is_decode else None  # prefills run eagerly, as in the engine
        logits = runner.forward(inputs)
        for s, row in zip(active, logits):
            s["tokens"].append(int(row.argmax()))

    step(seqs)  # prefill all three
    step(seqs[:1])  # one sequence: bucket 1, split KV
    for _ in range(5):
        step(seqs)  # three sequences: bucket 4 with one padding row
    for s, p in zip(seqs, prompts):
        n = len(s["tokens"]) - len(p)
        assert s["tokens"][len(p):] == hf_greedy(long_llama, p, n)


def test_one_graph_set_per_split_stream_captured_on_that_stream(long_llama: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Green-context splits: capture_graphs captures a set per stream (keyed as use_graphs takes them), each on its
    own stream and with every batch bucket, all in one memory pool; use_graphs picks the set a step replays."""
    model, cfg = load_model(long_llama)
    runner = ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 8, 16)), 16, "triton")
    captured = []

    def capture(self: DecodeGraphs, stream=None, pool=None, label: str = ""):
        captured.append((stream, pool))
        for bs in self.sizes:
            self.graphs[bs] = (f"graph {bs} on {stream}", None)
        return pool or "the pool"

    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    streams = {-1: "whole", 0: "decode on 32 SMs", 1: "decode on 64 SMs"}
    runner.capture_graphs(20, streams)
    assert captured == [("whole", None), ("decode on 32 SMs", "the pool"), ("decode on 64 SMs", "the pool")]
    for key, stream in streams.items():
        graphs = runner.graph_sets[key].graphs
        assert sorted(graphs) == bucket_sizes(20) and graphs[20][0] == f"graph 20 on {stream}"
    runner.use_graphs(1)
    assert runner.graphs is runner.graph_sets[1]
