"""Paged attention on the CPU in our kernels: decode rows in cpu_decode.c, prefill and append-prefill rows in
cpu_prefill.c; the linear layers on prepacked weights (cpu_linear.py).

Both kernels read each sequence's context in place through its block table, all of a step's rows of one kind in
one call per layer, across the CPU's threads: a decode row (one new token) is a dot product per key, a prefill
row a tile of flash attention with the other new tokens of its sequence. Where the kernels cannot be built
(engine/attention/cpu_kernel.py says why), the dtype is not float32 or bfloat16, or a KV head has more than
MAX_GROUP query heads, every row goes to PyTorch's SDPA over the gathered blocks, as in the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention.base import StepBatch
from engine.attention.cpu_kernel import DTYPES, load
from engine.attention.cpu_linear import CpuOps
from engine.attention.torch_backend import AttentionMetadata, TorchBackend, sdpa_attention, store_kv

MAX_GROUP = 64  # query heads per KV head the prefill kernel takes (its work items have at most 64 rows)


@dataclass
class Rows:
    """The sequences of a step whose rows go to one kernel, in step order."""

    rows: Tensor         # their rows of T, sequences concatenated (int64)
    tables: Tensor       # [sequences, longest table] int32, padded with block 0
    lens: Tensor         # [sequences] int32: each context after the step
    query_start: Tensor  # [sequences + 1] int32: each sequence's first row in `rows`
    everything: bool     # the rows are all of T, in order

    @staticmethod
    def of(batch: StepBatch, seqs: list[int]) -> Rows | None:
        if not seqs:
            return None
        qs = batch.query_start
        longest = max(len(batch.block_tables[i]) for i in seqs)
        tables = [batch.block_tables[i] + [0] * (longest - len(batch.block_tables[i])) for i in seqs]
        starts = [0]
        for i in seqs:
            starts.append(starts[-1] + qs[i + 1] - qs[i])
        return Rows(rows=torch.tensor([r for i in seqs for r in range(qs[i], qs[i + 1])], dtype=torch.int64),
                    tables=torch.tensor(tables, dtype=torch.int32).view(len(seqs), longest),
                    lens=torch.tensor([batch.seq_lens[i] for i in seqs], dtype=torch.int32),
                    query_start=torch.tensor(starts, dtype=torch.int32),
                    everything=len(seqs) == batch.num_seqs)


@dataclass
class CpuMetadata:
    full: AttentionMetadata  # the whole step, for SDPA when the kernels are not used
    decode: Rows | None      # sequences adding one token
    prefill: Rows | None     # sequences adding several (a prompt, or an append-prefill over cached tokens)


class CpuBackend(TorchBackend):
    name = "cpu"
    ops = CpuOps()

    def __init__(self, shape, device: torch.device) -> None:
        super().__init__(shape, device)
        self.kernels = load()

    def prepare(self, batch: StepBatch) -> CpuMetadata:
        qs = batch.query_start
        single = [i for i in range(batch.num_seqs) if qs[i + 1] - qs[i] == 1]
        several = [i for i in range(batch.num_seqs) if qs[i + 1] - qs[i] != 1]
        return CpuMetadata(full=super().prepare(batch), decode=Rows.of(batch, single),
                           prefill=Rows.of(batch, several))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: CpuMetadata,
                scale: float) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.full.slot_mapping)
        if (self.kernels is None or q.dtype not in DTYPES or q.dtype != k_cache.dtype
                or q.shape[1] // k_cache.shape[1] > MAX_GROUP):
            return sdpa_attention(q, k_cache, v_cache, meta.full, scale)
        bs = meta.full.block_size
        parts = []
        if meta.decode is not None:
            parts.append((meta.decode, self.kernels.paged_decode, ()))
        if meta.prefill is not None:
            parts.append((meta.prefill, self.kernels.paged_prefill, (meta.prefill.query_start,)))
        if len(parts) == 1 and parts[0][0].everything:
            rows, kernel, extra = parts[0]
            return kernel(q, k_cache, v_cache, rows.tables, rows.lens, *extra, scale, bs)
        out = torch.empty_like(q)
        for rows, kernel, extra in parts:
            out[rows.rows] = kernel(q[rows.rows], k_cache, v_cache, rows.tables, rows.lens, *extra, scale, bs)
        return out
