"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the metadata refilled in place.

A decode step (every sequence adds one token and samples it) is captured for the
bucket sizes up to max_batch, largest first, all in one memory pool. Inputs live
in static buffers; a step of n sequences replays the smallest bucket >= n, whose
padding rows carry token 0 at position 0, write no KV (slot -1) and attend to
nothing (seq_len 0). Prefill and mixed steps run eagerly. The graphs keep the
pointers of the KV pool bound at capture: capture after the real pool is bound.

A graph keeps the SM partition of the stream it was captured on (a green
context's), so a unit on green-context splits captures one set per split, each
on its split's decode stream and replayed there; the sets share one memory pool,
as only one of them replays at a time.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, StepBatch
from engine.model import Model

log = logging.getLogger("ppd.engine")

MAX_GRAPH_BATCH = 512


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (which is always included)."""
    max_batch = min(max_batch, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes) | {max_batch})


class DecodeGraphs:
    """Captured decode steps for batches of up to max_batch sequences."""

    def __init__(self, model: Model, backend: AttentionBackend, max_batch: int) -> None:
        assert backend.supports_cuda_graphs, f"the {backend.name} backend cannot be captured"
        self.model, self.backend = model, backend
        self.sizes = bucket_sizes(max_batch)
        device = model.rope_cos.device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.host_inputs = torch.zeros(2, n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.static = backend.graph_metadata(n)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture(self, stream: torch.cuda.Stream | None = None, pool: Any = None, label: str = "") -> Any:
        """Capture every bucket on stream (a new ordinary one if None), largest first so that smaller graphs reuse
        the pool's memory; pool: a pool to share with other sets. Returns the pool."""
        started = time.monotonic()
        stream = stream or torch.cuda.Stream()
        # The static buffers were filled on the current stream: the warm-up steps on stream must not read them
        # (a slot mapping of -1s not yet written is a store anywhere in memory) before those fills ran.
        stream.wait_stream(torch.cuda.current_stream())
        for bs in reversed(self.sizes):
            meta = self.backend.graph_view(self.static, bs)
            with torch.cuda.stream(stream):
                self._forward(bs, meta)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self._forward(bs, meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d decode graphs (batch 1..%d%s) in %.1fs", len(self.sizes), self.max_batch, label,
                 time.monotonic() - started)
        return pool

    def fits(self, batch: StepBatch) -> bool:
        return batch.is_decode and batch.num_seqs <= self.max_batch

    def run(self, batch: StepBatch) -> Tensor:
        """Float32 logits [batch.num_seqs, vocab] of a decode step, by replaying the smallest bucket that fits.
        The inputs go through pinned staging buffers: the caller syncs (the sampler's copy to the host does)
        before the next run rewrites them."""
        n = batch.num_seqs
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        host = self.host_inputs.numpy()
        host[0, :n] = batch.token_ids
        host[1, :n] = batch.positions
        host[:, n:bs] = 0
        self.input_ids[:bs].copy_(self.host_inputs[0, :bs], non_blocking=True)
        self.positions[:bs].copy_(self.host_inputs[1, :bs], non_blocking=True)
        self.backend.fill_graph_metadata(self.static, batch, bs)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:n]

    def _forward(self, bs: int, meta: Any) -> Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.backend, meta)
        return self.model.compute_logits(hidden, self.backend.ops)
