"""One model step over a batch of sequences (prefills, append-prefills, prefill chunks and decodes
mixed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engine.attention import AttentionBackend, AttentionShape, StepBatch, create_backend
from engine.attention.base import pad_tables
from engine.cuda_graphs import DEFAULT_GRAPH_TOKENS, StepGraphs, cublas_sm_target
from engine.model import Model
from engine.quant import FP8
from engine.staging import Staging, take_previous


@dataclass(frozen=True)
class PromptLogprobsAsk:
    """Logprobs of prompt tokens from an input's leading positions: the position start_pos + i
    predicts targets[i] (the prompt's next token); top alternatives beside each."""

    targets: list[int]
    top: int

    @classmethod
    def for_chunk(
        cls, top: int | None, token_ids: Sequence[int], num_prompt: int, start: int, end: int
    ) -> PromptLogprobsAsk | None:
        """What a chunk computing positions [start, end) of a request's first pass asks (None:
        nothing; top None: the request asked for no prompt logprobs). The last prompt position
        predicts the first output token, not a prompt token, so it asks nothing."""
        last = min(end, num_prompt - 1)
        if top is None or last <= start:
            return None
        return cls(list(token_ids[start + 1 : last + 1]), top)


@dataclass
class StepInput:
    """One sequence's share of a step: the tokens whose KV is computed now, on top of start_pos
    cached ones."""

    token_ids: list[int]  # at least 1
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: Sequence[
        int
    ]  # blocks covering at least start_pos + len(token_ids) tokens (a list or an int32 array)
    sample: bool = True  # return logits for the last token of this input
    prompt_logprobs: PromptLogprobsAsk | None = (
        None  # keep the hidden states of the leading positions it names
    )
    # Where the one token is not known yet on the host: its index among the sampled tokens of the
    # step before, which the runner is given (ModelRunner.run); token_ids then holds a stand-in that
    # is never read.
    previous: int = -1


class ModelRunner:
    """Runs one step of the model over a batch of StepInputs against a paged KV pool.

    Once capture_graphs has run, every step that fits a captured bucket (decode steps, and steps of
    up to max_tokens tokens without prompt logprobs) replays a CUDA graph; everything else runs
    eagerly, its small inputs staged in pinned memory so that nothing waits for the device. With one
    graph set per stream (green-context splits), use_graphs(key) picks the set of the stream the
    next steps run on; graphs = None runs every step eagerly.
    """

    def __init__(
        self,
        model: Model,
        kv_pool: Tensor,
        block_size: int,
        backend: str | AttentionBackend = "auto",
        max_model_len: int | None = None,
    ) -> None:
        assert kv_pool.shape[3] == block_size, "kv_pool was built for another block size"
        self.model, self.block_size, self.device = model, block_size, kv_pool.device
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        fp8 = model.cfg.quantization is not None or kv_pool.dtype == FP8
        if backend == "auto" and fp8 and self.device.type == "cpu":
            backend = "torch"  # the CPU's C kernels do not read FP8
        if isinstance(backend, str):
            cfg = model.cfg
            shape = AttentionShape(
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                block_size,
                -(-self.max_model_len // block_size),
            )
            backend = create_backend(backend, shape, self.device)
        if backend.name == "cpu" and fp8:
            raise ValueError(
                "the cpu attention backend's C kernels read bfloat16, float16 or float32 weights "
                "and KV; FP8 weights or an FP8 KV cache run on the CPU through --attention-backend "
                "torch"
            )
        self.backend = backend
        self.graphs: StepGraphs | None = None  # the set steps replay now
        self.graph_sets: dict[Any, StepGraphs] = {}
        self.graph_key: Any = (
            None  # the stream key of use_graphs (a tensor-parallel follower's steps take rank 0's)
        )
        self._graph_pool: Any = None
        self.staging = Staging(
            torch.int64, self.device, depth=4
        )  # two fills a step: inputs, previous tokens
        self.bind_kv_cache(kv_pool)

    def bind_kv_cache(self, kv_pool: Tensor) -> None:
        """Point the model at a pool (start-up measures on a scratch pool first, then binds the real
        one)."""
        assert self.graphs is None, "captured graphs keep the pool they were captured with"
        self.kv_pool = kv_pool
        self.model.bind_kv_cache(kv_pool)

    def capture_graphs(
        self,
        max_batch: int,
        streams: dict[Any, torch.cuda.Stream] | None = None,
        sms: dict[Any, int] | None = None,
        max_tokens: int = DEFAULT_GRAPH_TOKENS,
        decode: bool = True,
        sm_target: bool = False,
    ) -> None:
        """Capture graph sets (CUDA, and a backend that supports it) of decode steps of up to
        max_batch sequences (unless decode is False: a prefill worker's) and steps of up to
        max_tokens tokens: one set on an ordinary stream, or one per stream of streams (keyed as
        use_graphs takes them), its decode KV splits sized for sms[key] SMs (missing: the whole
        device). sm_target: each set is captured under cublas_sm_target of the device's SMs less
        its own (0 for the whole device). A later call adds sets of the same buckets; all share
        one memory pool and one set of static inputs and outputs."""
        io = next(iter(self.graph_sets.values())).io if self.graph_sets else None
        total = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if sm_target else 0
        )
        for key, stream in (streams or {None: None}).items():
            graphs = StepGraphs(
                self.model, self.backend, max_batch, max_tokens, (sms or {}).get(key), io, decode
            )
            io = graphs.io
            carveout = total - (sms or {}).get(key, total) if sm_target else None
            label = ("" if key is None else f", stream {key}") + (
                f", cuBLASLt SM target {total - carveout}" if carveout is not None else ""
            )
            with cublas_sm_target(carveout):
                self._graph_pool = graphs.capture(stream, self._graph_pool, label)
            self.graph_sets[key] = graphs
        if self.graphs is None:
            self.graphs = next(iter(self.graph_sets.values()))

    def use_graphs(self, key: Any) -> None:
        """Replay the set captured on stream key from the next step (the caller runs it on that
        stream)."""
        self.graph_key = key
        if self.graph_sets:
            self.graphs = self.graph_sets[key]

    def forward(self, inputs: list[StepInput], previous: Tensor | None = None) -> Tensor:
        """float32 logits [number of inputs with sample=True, vocab], in input order (previous: as
        for run)."""
        return self.run(inputs, previous)[0]

    @torch.inference_mode()
    def run(
        self, inputs: list[StepInput], previous: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """forward's logits, and the final hidden states of the positions the inputs ask prompt
        logprobs for (in input order; None when none asks). Logits from a graph are valid until the
        next step. previous: the sampled tokens (on the device) of the step before, which inputs
        with `previous` set take their token from."""
        batch = self.make_batch(inputs)
        if self.graphs is not None and (bucket := self.graphs.bucket_for(batch)) is not None:
            return self.graphs.run(batch, bucket, previous), None
        meta = self.backend.prepare(batch)
        t, s, k = len(batch.token_ids), len(batch.sample_rows), len(batch.hidden_rows)
        at = t + t % 2  # positions 16-byte aligned: the RoPE kernel reads them
        host = self.staging.buffer(at + t + s + k)
        host[:t] = batch.token_ids
        host[at : at + t] = batch.positions
        host[at + t : at + t + s] = batch.sample_rows
        host[at + t + s :] = batch.hidden_rows
        ints = self.staging.to_device()
        take_previous(ints[:t], batch.previous, previous, self.staging)
        hidden = self.model(ints[:t], ints[at : at + t], self.backend, meta)
        kept = hidden[ints[at + t + s :]] if k else None
        if s < t:
            hidden = hidden[ints[at + t : at + t + s]]
        return self.model.compute_logits(hidden, self.backend.ops), kept

    def make_batch(self, inputs: list[StepInput]) -> StepBatch:
        """The host-side description of the step (token ids, positions, KV slots, per-sequence
        offsets), built in numpy: per sequence a few C-level operations, no Python per token or per
        block. Inputs of one token (that keep no hidden states) come first, so that attention runs
        them on its decode grid and the rest on its general grid; sampled and kept rows are listed
        in input order, so logits come out in it."""
        assert inputs, "a step needs at least one input"
        bs, n = self.block_size, len(inputs)
        lens = np.fromiter(map(_num_tokens, inputs), np.int64, n)
        single = (lens == 1) & np.fromiter((inp.prompt_logprobs is None for inp in inputs), bool, n)
        num_single = int(single.sum())
        order = (
            np.arange(n)
            if num_single in (0, n)
            else np.concatenate([np.flatnonzero(single), np.flatnonzero(~single)])
        )
        ordered = [inputs[i] for i in order.tolist()]
        lens = lens[order]
        starts = np.fromiter((inp.start_pos for inp in ordered), np.int64, n)
        ends = starts + lens
        tables = [inp.block_table for inp in ordered]
        table_lens = np.fromiter(map(len, tables), np.int64, n)
        assert lens.min() >= 1 and (table_lens * bs >= ends).all(), (
            "empty input or block table too short"
        )
        assert ends.max() <= self.max_model_len, (
            f"sequence longer than max_model_len ({self.max_model_len})"
        )
        padded = pad_tables(tables)
        query_start = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=query_start[1:])
        t = int(query_start[-1])
        if num_single == n:  # a decode step: one token per sequence
            seq_of, positions = np.arange(n), starts
        else:
            seq_of = np.repeat(np.arange(n), lens)
            positions = starts[seq_of] + np.arange(t) - query_start[seq_of]
        slots = padded[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        rows = np.empty(n, np.int64)
        rows[order] = query_start[1:] - 1
        last_row = rows.tolist()  # each input's last row of T, in input order
        sample_rows = [row for row, inp in zip(last_row, inputs) if inp.sample]
        hidden_rows: list[int] = []
        previous = [(row, inp.previous) for row, inp in zip(last_row, inputs) if inp.previous >= 0]
        for row, inp in zip(last_row, inputs):
            if inp.prompt_logprobs is not None:
                k = len(inp.prompt_logprobs.targets)
                assert k <= len(inp.token_ids), "prompt logprobs beyond the input"
                first = row + 1 - len(inp.token_ids)
                hidden_rows += range(first, first + k)
        token_ids = list(chain.from_iterable(inp.token_ids for inp in ordered))
        return StepBatch(
            token_ids,
            positions.tolist(),
            slots.tolist(),
            query_start.tolist(),
            ends.tolist(),
            tables,
            sample_rows,
            bs,
            hidden_rows,
            num_decodes=num_single,
            tables=padded,
            previous=previous,
        )


def _num_tokens(inp: StepInput) -> int:
    return len(inp.token_ids)
