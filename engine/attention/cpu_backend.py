"""Paged attention on the CPU: decode rows in our kernel (cpu_decode.c), the rest in PyTorch's SDPA; the linear
layers on prepacked weights (cpu_linear.py).

A decode row (a sequence adding one token) reads its context in place through its block table, each key and
value once, all of a step's decode rows in one call per layer, across the CPU's threads. Prefill and
append-prefill rows are matrix work, which SDPA's flash kernel does over the blocks gathered for them. Where the
kernel cannot be built (engine/attention/cpu_kernel.py says why) or the dtype is not float32 or bfloat16, every
row goes to SDPA, as in the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention.base import StepBatch
from engine.attention.cpu_kernel import DTYPES, load
from engine.attention.cpu_linear import CpuOps
from engine.attention.torch_backend import AttentionMetadata, TorchBackend, sdpa_attention, store_kv


@dataclass
class CpuMetadata:
    full: AttentionMetadata  # the whole step, for SDPA when the kernel is not used
    decode_rows: Tensor      # rows of T that are decode rows (one query each), in sequence order
    decode_tables: Tensor    # [decode rows, longest table] int32, padded with block 0
    decode_lens: Tensor      # [decode rows] int32
    rest_rows: Tensor        # the other rows of T
    rest: AttentionMetadata | None  # the other sequences, for SDPA (None when every row decodes)


class CpuBackend(TorchBackend):
    name = "cpu"
    ops = CpuOps()

    def __init__(self, shape, device: torch.device) -> None:
        super().__init__(shape, device)
        self.kernels = load()

    def prepare(self, batch: StepBatch) -> CpuMetadata:
        full = super().prepare(batch)
        qs = batch.query_start
        decode = [i for i in range(batch.num_seqs) if qs[i + 1] - qs[i] == 1]
        rest = [i for i in range(batch.num_seqs) if qs[i + 1] - qs[i] != 1]
        longest = max((len(batch.block_tables[i]) for i in decode), default=0)
        tables = [batch.block_tables[i] + [0] * (longest - len(batch.block_tables[i])) for i in decode]
        rest_rows = [r for i in rest for r in range(qs[i], qs[i + 1])]
        rest_meta = None
        if rest:
            starts = [0]
            for i in rest:
                starts.append(starts[-1] + qs[i + 1] - qs[i])
            rest_meta = AttentionMetadata(
                slot_mapping=full.slot_mapping[:0], query_start=starts,
                context_lens=[batch.seq_lens[i] for i in rest], block_tables=[batch.block_tables[i] for i in rest],
                block_size=batch.block_size)
        return CpuMetadata(
            full=full,
            decode_rows=torch.tensor([qs[i] for i in decode], dtype=torch.int64),
            decode_tables=torch.tensor(tables, dtype=torch.int32).view(len(decode), longest),
            decode_lens=torch.tensor([batch.seq_lens[i] for i in decode], dtype=torch.int32),
            rest_rows=torch.tensor(rest_rows, dtype=torch.int64),
            rest=rest_meta)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: CpuMetadata,
                scale: float) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.full.slot_mapping)
        if self.kernels is None or q.dtype not in DTYPES or q.dtype != k_cache.dtype or not len(meta.decode_rows):
            return sdpa_attention(q, k_cache, v_cache, meta.full, scale)
        if meta.rest is None:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
        out[meta.rest_rows] = sdpa_attention(q[meta.rest_rows], k_cache, v_cache, meta.rest, scale)
        return out

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: CpuMetadata, scale: float) -> Tensor:
        return self.kernels.paged_decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, scale,
                                         meta.full.block_size)
