"""One model step over a batch of sequences (prefills, append-prefills, prefill chunks and decodes mixed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.attention import AttentionBackend, AttentionShape, StepBatch, create_backend
from engine.cuda_graphs import DEFAULT_GRAPH_TOKENS, StepGraphs, cublas_sm_target
from engine.model import Model
from engine.staging import Staging


@dataclass(frozen=True)
class PromptLogprobsAsk:
    """Logprobs of prompt tokens from an input's leading positions: the position start_pos + i predicts targets[i]
    (the prompt's next token); top alternatives beside each."""

    targets: list[int]
    top: int

    @classmethod
    def for_chunk(cls, top: int | None, token_ids: Sequence[int], num_prompt: int, start: int,
                  end: int) -> PromptLogprobsAsk | None:
        """What a chunk computing positions [start, end) of a request's first pass asks (None: nothing; top None: the
        request asked for no prompt logprobs). The last prompt position predicts the first output token, not a
        prompt token, so it asks nothing."""
        last = min(end, num_prompt - 1)
        if top is None or last <= start:
            return None
        return cls(list(token_ids[start + 1:last + 1]), top)


@dataclass
class StepInput:
    """One sequence's share of a step: the tokens whose KV is computed now, on top of start_pos cached ones."""

    token_ids: list[int]  # at least 1
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # blocks covering at least start_pos + len(token_ids) tokens
    sample: bool = True  # return logits for the last token of this input
    prompt_logprobs: PromptLogprobsAsk | None = None  # keep the hidden states of the leading positions it names


class ModelRunner:
    """Runs one step of the model over a batch of StepInputs against a paged KV pool.

    Once capture_graphs has run, every step that fits a captured bucket (decode steps, and steps of up to
    max_tokens tokens without prompt logprobs) replays a CUDA graph; everything else runs eagerly, its small inputs
    staged in pinned memory so that nothing waits for the device. With one graph set per stream (green-context
    splits), use_graphs(key) picks the set of the stream the next steps run on; graphs = None runs every step
    eagerly.
    """

    def __init__(self, model: Model, kv_pool: Tensor, block_size: int, backend: str | AttentionBackend = "auto",
                 max_model_len: int | None = None) -> None:
        assert kv_pool.shape[3] == block_size, "kv_pool was built for another block size"
        self.model, self.block_size, self.device = model, block_size, kv_pool.device
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        if isinstance(backend, str):
            cfg = model.cfg
            shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size,
                                   -(-self.max_model_len // block_size))
            backend = create_backend(backend, shape, self.device)
        self.backend = backend
        self.graphs: StepGraphs | None = None  # the set steps replay now
        self.graph_sets: dict[Any, StepGraphs] = {}
        self.graph_key: Any = None  # the stream key of use_graphs (a tensor-parallel follower's steps take rank 0's)
        self._graph_pool: Any = None
        self.staging = Staging(torch.int64, self.device)
        self.bind_kv_cache(kv_pool)

    def bind_kv_cache(self, kv_pool: Tensor) -> None:
        """Point the model at a pool (start-up measures on a scratch pool first, then binds the real one)."""
        assert self.graphs is None, "captured graphs keep the pool they were captured with"
        self.kv_pool = kv_pool
        self.model.bind_kv_cache(kv_pool)

    def capture_graphs(self, max_batch: int, streams: dict[Any, torch.cuda.Stream] | None = None,
                       sms: dict[Any, int] | None = None, max_tokens: int = DEFAULT_GRAPH_TOKENS,
                       decode: bool = True, sm_target: bool = False) -> None:
        """Capture graph sets (CUDA, and a backend that supports it) of decode steps of up to max_batch sequences
        (unless decode is False: a prefill worker's) and steps of up to max_tokens tokens: one set on an ordinary
        stream, or one per stream of streams (keyed as use_graphs takes them), its decode KV splits sized for
        sms[key] SMs (missing: the whole device). sm_target: each set is captured under cublas_sm_target of the
        device's SMs less its own (0 for the whole device). A later call adds sets of the same buckets; all share one
        memory pool and one set of static inputs and outputs."""
        io = next(iter(self.graph_sets.values())).io if self.graph_sets else None
        total = torch.cuda.get_device_properties(self.device).multi_processor_count if sm_target else 0
        for key, stream in (streams or {None: None}).items():
            graphs = StepGraphs(self.model, self.backend, max_batch, max_tokens, (sms or {}).get(key), io, decode)
            io = graphs.io
            carveout = total - (sms or {}).get(key, total) if sm_target else None
            label = ("" if key is None else f", stream {key}") + (
                f", cuBLASLt SM target {total - carveout}" if carveout is not None else "")
            with cublas_sm_target(carveout):
                self._graph_pool = graphs.capture(stream, self._graph_pool, label)
            self.graph_sets[key] = graphs
        if self.graphs is None:
            self.graphs = next(iter(self.graph_sets.values()))

    def use_graphs(self, key: Any) -> None:
        """Replay the set captured on stream key from the next step (the caller runs it on that stream)."""
        self.graph_key = key
        if self.graph_sets:
            self.graphs = self.graph_sets[key]

    def forward(self, inputs: list[StepInput]) -> Tensor:
        """float32 logits [number of inputs with sample=True, vocab], in input order."""
        return self.run(inputs)[0]

    @torch.inference_mode()
    def run(self, inputs: list[StepInput]) -> tuple[Tensor, Tensor | None]:
        """forward's logits, and the final hidden states of the positions the inputs ask prompt logprobs for (in
        input order; None when none asks). Logits from a graph are valid until the next step."""
        batch = self.make_batch(inputs)
        if self.graphs is not None and (bucket := self.graphs.bucket_for(batch)) is not None:
            return self.graphs.run(batch, bucket), None
        meta = self.backend.prepare(batch)
        t, s, k = len(batch.token_ids), len(batch.sample_rows), len(batch.hidden_rows)
        at = t + t % 2  # positions 16-byte aligned: the RoPE kernel reads them
        host = self.staging.buffer(at + t + s + k)
        host[:t] = batch.token_ids
        host[at : at + t] = batch.positions
        host[at + t : at + t + s] = batch.sample_rows
        host[at + t + s :] = batch.hidden_rows
        ints = self.staging.to_device()
        hidden = self.model(ints[:t], ints[at : at + t], self.backend, meta)
        kept = hidden[ints[at + t + s :]] if k else None
        if s < t:
            hidden = hidden[ints[at + t : at + t + s]]
        return self.model.compute_logits(hidden, self.backend.ops), kept

    def make_batch(self, inputs: list[StepInput]) -> StepBatch:
        """The host-side description of the step (token ids, positions, KV slots, per-sequence offsets). Inputs of
        one token (that keep no hidden states) come first, so that attention runs them on its decode grid and the
        rest on its general grid; sampled and kept rows are listed in input order, so logits come out in it."""
        assert inputs, "a step needs at least one input"
        bs, max_len = self.block_size, self.max_model_len
        single = [i for i, inp in enumerate(inputs) if len(inp.token_ids) == 1 and inp.prompt_logprobs is None]
        order = range(len(inputs))
        if 0 < len(single) < len(inputs):
            several = set(order).difference(single)
            order = single + sorted(several)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens, tables = [0], [], []
        last_row = [0] * len(inputs)
        for i in order:
            inp = inputs[i]
            end = inp.start_pos + len(inp.token_ids)
            assert inp.token_ids and len(inp.block_table) * bs >= end, "empty input or block table too short"
            assert end <= max_len, f"sequence longer than max_model_len ({max_len})"
            token_ids += inp.token_ids
            table = inp.block_table
            if len(inp.token_ids) == 1:  # decode: skip the range machinery
                p = inp.start_pos
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            else:
                positions += range(inp.start_pos, end)
                slots += [table[p // bs] * bs + p % bs for p in range(inp.start_pos, end)]
            query_start.append(len(token_ids))
            seq_lens.append(end)
            tables.append(table)
            last_row[i] = len(token_ids) - 1
        sample_rows = [last_row[i] for i, inp in enumerate(inputs) if inp.sample]
        hidden_rows: list[int] = []
        for i, inp in enumerate(inputs):
            if inp.prompt_logprobs is not None:
                n = len(inp.prompt_logprobs.targets)
                assert n <= len(inp.token_ids), "prompt logprobs beyond the input"
                first = last_row[i] + 1 - len(inp.token_ids)
                hidden_rows += range(first, first + n)
        return StepBatch(token_ids, positions, slots, query_start, seq_lens, tables, sample_rows, bs, hidden_rows,
                         num_decodes=len(single))
