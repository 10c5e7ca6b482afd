"""CUDA graphs for every step of up to a few hundred tokens: decode steps, and prefill,
append-prefill and mixed steps, each replayed from a graph captured at a fixed shape (a
GraphBucket) with the metadata refilled in place.

Two families of buckets, all captured in one memory pool, largest first:
- decode: a batch of b sequences adding one token each and sampling it, for b in 1, 2, 4, 8, then
  every 16 up to max_batch; attention runs its decode grid, with the KV splits chosen for the bucket
  and the SMs the set runs on;
- tokens: up to t new tokens of up to min(max_batch, t) sequences (any mix of prompts,
  append-prefills, prefill chunks and decodes), for t in 16, 32, then every 32 up to 256 and every
  64 up to max_tokens; attention runs its general grid with the tile chosen for a query of t tokens,
  the batch padded with sequences of no tokens. A step replays the smallest bucket that holds it.
  Padding writes no KV (slot -1), attends to nothing and is never sampled: the sampled rows are
  gathered through a static index. Steps that keep hidden states (prompt logprobs) or exceed every
  bucket run eagerly.

Inputs and outputs live in static buffers: token ids, positions and sampled rows here (refilled
through pinned staging, so a replay never waits for the device), the attention metadata in the
backend's, and the logits in one float32 buffer that every bucket writes; a step's logits are valid
until the next step of the same set. The graphs keep the pointers of the KV pool bound at capture:
capture after the real pool is bound.

A graph keeps the SM partition of the stream it was captured on (a green context's), so a unit on
green-context splits captures one set per split, each on its split's stream, with split-KV counts
for its SMs, and replays it there; the sets share one memory pool and their inputs and outputs, as
only one of them replays at a time. cuBLAS does not see a green context's SMs (until CUDA 13.3) and
may pick a GEMM's tiles for the whole device; with the SM target on (--cublas-sm-target), each set
is captured inside cublas_sm_target for its SMs.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, GraphBucket, StepBatch
from engine.model import Model
from engine.staging import Staging, take_previous

log = logging.getLogger("ppd.engine")

MAX_GRAPH_BATCH = 512
DEFAULT_GRAPH_TOKENS = 512  # steps of up to this many tokens replay a graph (--max-graph-tokens)
MAX_GRAPH_TOKENS = 1024
# The carveout and the preferred BLAS library are process-wide (torch's global context), and in a
# one-process unit the prefill thread captures its sets while the decode thread runs: one section at
# a time sets them and puts them back.
_BLAS_SETTINGS = threading.Lock()


def bucket_sizes(max_batch: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then every 16 up to max_batch (which is always included)."""
    max_batch = min(max_batch, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes) | {max_batch})


def token_bucket_sizes(max_tokens: int) -> list[int]:
    """Token buckets: 16, 32, then every 32 up to 256 and every 64 up to max_tokens (always
    included); none for 0."""
    if max_tokens <= 0:
        return []
    max_tokens = min(max_tokens, MAX_GRAPH_TOKENS)
    sizes = (
        [16] + list(range(32, min(max_tokens, 256) + 1, 32)) + list(range(320, max_tokens + 1, 64))
    )
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def graph_buckets(max_batch: int, max_tokens: int, decode: bool = True) -> list[GraphBucket]:
    """Every bucket of a set (without decode's, for a prefill worker), decode buckets first, each
    family smallest first."""
    max_batch = min(max_batch, MAX_GRAPH_BATCH)
    return [GraphBucket(b, b, True) for b in bucket_sizes(max_batch) if decode] + [
        GraphBucket(t, min(max_batch, t), False) for t in token_bucket_sizes(max_tokens)
    ]


@contextlib.contextmanager
def cublas_sm_target(carveout: int | None) -> Iterator[None]:
    """Within: GEMMs go through cuBLASLt, told to leave `carveout` of the device's SMs aside (its SM
    count target, set by torch._C._set_sm_carveout_experimental); the carveout and library are put
    back after. None: nothing changes. Both settings are process-wide, so such sections run one at a
    time, and a GEMM another thread launches meanwhile (an eager step) runs under them too."""
    if carveout is None:
        yield
        return
    with _BLAS_SETTINGS:
        library, before = (
            torch.backends.cuda.preferred_blas_library(),
            torch._C._get_sm_carveout_experimental(),
        )
        # As torch's source reads, it hands the target to cuBLASLt only: its cuBLAS path
        # (cublasGemmEx, the default for a bias-free bf16 linear) takes no SM count, so without
        # cuBLASLt the target would do nothing.
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(before)
            torch.backends.cuda.preferred_blas_library(library)


class GraphIO:
    """The static inputs and outputs of a runner's graph sets: token ids, positions and sampled rows
    in one int64 device buffer, filled through one pinned staging ring; the logits of every
    bucket in one float32 buffer."""

    def __init__(self, buckets: list[GraphBucket], vocab_size: int, device: torch.device) -> None:
        self.tokens = max(b.tokens for b in buckets)
        self.samples = max(b.seqs for b in buckets)
        self.ints = torch.zeros(2 * self.tokens + self.samples, dtype=torch.int64, device=device)
        self.input_ids = self.ints[: self.tokens]
        self.positions = self.ints[self.tokens : 2 * self.tokens]
        self.sample_rows = self.ints[2 * self.tokens :]
        self.logits = torch.zeros(self.samples, vocab_size, dtype=torch.float32, device=device)
        self.staging = Staging(
            torch.int64, device, depth=4
        )  # two fills a step: the inputs, the previous tokens

    def fill(self, batch: StepBatch, bucket: GraphBucket) -> None:
        """Stage batch's token ids, positions and sampled rows, padded to bucket with zeros, and
        queue their copy."""
        big_t, t, s = self.tokens, len(batch.token_ids), len(batch.sample_rows)
        host = self.staging.buffer(self.ints.numel())
        host[:t] = batch.token_ids
        host[t : bucket.tokens] = 0
        host[big_t : big_t + t] = batch.positions
        host[big_t + t : big_t + bucket.tokens] = 0
        host[2 * big_t : 2 * big_t + s] = batch.sample_rows
        host[2 * big_t + s : 2 * big_t + bucket.seqs] = 0
        self.staging.to_device(self.ints)


class StepGraphs:
    """One set of captured steps (graph_buckets(max_batch, max_tokens)) on one stream."""

    def __init__(
        self,
        model: Model,
        backend: AttentionBackend,
        max_batch: int,
        max_tokens: int = DEFAULT_GRAPH_TOKENS,
        num_sms: int | None = None,
        io: GraphIO | None = None,
        decode: bool = True,
    ) -> None:
        assert backend.supports_cuda_graphs, f"the {backend.name} backend cannot be captured"
        self.model, self.backend = model, backend
        self.buckets = graph_buckets(max_batch, max_tokens, decode)
        assert self.buckets, "a graph set needs decode buckets or max_tokens > 0"
        self.decode = [b for b in self.buckets if b.decode]
        self.tokens = [b for b in self.buckets if not b.decode]
        self._decode_seqs = [b.seqs for b in self.decode]  # bucket_for's bisections, once
        self._token_counts = [b.tokens for b in self.tokens]
        self.io = io or GraphIO(self.buckets, model.cfg.vocab_size, model.rope_cos.device)
        assert (
            self.io.tokens >= max(b.tokens for b in self.buckets)
            and self.io.samples >= self.max_batch
        )
        self.static = backend.graph_metadata(self.buckets, num_sms)
        self.graphs: dict[
            GraphBucket, Any
        ] = {}  # a torch.cuda.CUDAGraph (tests stand in an eager replay)

    @property
    def max_batch(self) -> int:
        return max(b.seqs for b in self.buckets)

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1].tokens if self.tokens else 0

    def capture(
        self, stream: torch.cuda.Stream | None = None, pool: Any = None, label: str = ""
    ) -> Any:
        """Capture every bucket on stream (a new ordinary one if None), largest first so that
        smaller graphs reuse the pool's memory; pool: a pool to share with other sets. Returns
        the pool."""
        started = time.monotonic()
        stream = stream or torch.cuda.Stream()
        # The static buffers were filled on the current stream: the warm-up steps on stream must not
        # read them (a slot mapping of -1s not yet written is a store anywhere in memory) before
        # those fills ran.
        stream.wait_stream(torch.cuda.current_stream())
        for bucket in sorted(self.buckets, key=lambda b: (b.tokens, b.decode), reverse=True):
            with torch.cuda.stream(stream):
                self.forward(bucket)  # compiles the kernels for this shape outside the capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # Thread-local: in a one-process unit the prefill thread captures while the decode
            # thread may run.
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                self.forward(bucket)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
        stream.synchronize()
        log.info(
            "captured %d graphs (decode batch %s, steps of %s tokens%s) in %.1fs",
            len(self.buckets),
            f"1..{self.decode[-1].seqs}" if self.decode else "none",
            f"16..{self.max_tokens}" if self.tokens else "none",
            label,
            time.monotonic() - started,
        )
        return pool

    def bucket_for(self, batch: StepBatch) -> GraphBucket | None:
        """The smallest bucket that holds batch, or None (it runs eagerly)."""
        n = batch.num_seqs
        if batch.hidden_rows or n > self.max_batch:
            return None
        if batch.is_decode and self.decode:
            return self.decode[bisect.bisect_left(self._decode_seqs, n)]
        t = len(batch.token_ids)
        if t > self.max_tokens:
            return None
        return self.tokens[bisect.bisect_left(self._token_counts, t)]

    def run(self, batch: StepBatch, bucket: GraphBucket, previous: Tensor | None = None) -> Tensor:
        """Float32 logits [sampled rows of batch, vocab], by replaying bucket's graph (from
        bucket_for(batch)); previous: the step before's sampled tokens, where the batch takes some
        (ModelRunner.run)."""
        self.io.fill(batch, bucket)
        take_previous(self.io.input_ids, batch.previous, previous, self.io.staging)
        self.backend.fill_graph_metadata(self.static, batch, bucket)
        self.graphs[bucket].replay()
        return self.io.logits[: len(batch.sample_rows)]

    def forward(self, bucket: GraphBucket) -> None:
        """The step a bucket's graph captures: the model over the static inputs, logits into
        io.logits."""
        meta = self.backend.graph_view(
            self.static, bucket
        )  # fresh: its per-step buffers come from the pool
        io = self.io
        hidden = self.model(
            io.input_ids[: bucket.tokens], io.positions[: bucket.tokens], self.backend, meta
        )
        if not bucket.decode:
            hidden = hidden.index_select(0, io.sample_rows[: bucket.seqs])
        self.model.compute_logits(hidden, self.backend.ops, out=io.logits[: bucket.seqs])
