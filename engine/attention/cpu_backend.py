"""Paged attention on the CPU in our kernels: decode rows in cpu_decode.c, prefill and
append-prefill rows in cpu_prefill.c; the linear layers on prepacked weights (cpu_linear.py).

Both kernels read each sequence's context in place through its block table, all of a step's rows of
one kind in one call per layer, across the CPU's threads: a decode row (one new token) is a dot
product per key, a prefill row a tile of flash attention with the other new tokens of its sequence.
Where the kernels cannot be built (engine/attention/cpu_kernel.py says why), the dtype is not
float32 or bfloat16, or a KV head has more than MAX_GROUP query heads, every row goes to PyTorch's
SDPA over the gathered blocks, as in the torch backend.

bfloat16 prefill rows on a CPU with AMX go to PyTorch's SDPA as well, per sequence over its gathered
blocks: its flash attention multiplies tiles on AMX, where our kernel's AVX512-BF16 dot products are
no faster than its float32 path, so SDPA is the faster there, gather and masks included
(docs/cpu-engine.md#measurements-behind-the-code). float32, and CPUs without AMX, keep our kernel.

An fp8 KV pool is refused at the first layer that stores into it (refuse_fp8); the torch backend
reads one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention.base import StepBatch
from engine.attention.cpu_kernel import DTYPES, load
from engine.attention.cpu_linear import CpuOps, rope_takes
from engine.attention.torch_backend import (
    FP8,
    AttentionMetadata,
    TorchBackend,
    sdpa_attention,
    store_kv,
)
from engine.cpu_isa import cpu_flags

MAX_GROUP = (
    64  # query heads per KV head the prefill kernel takes (its work items have at most 64 rows)
)


@dataclass
class Rows:
    """The sequences of a step whose rows go to one kernel, in step order."""

    rows: Tensor  # their rows of T, sequences concatenated (int64)
    # [sequences, longest table] int32, padded with block 0 (rows of StepBatch.padded_tables)
    tables: Tensor
    lens: Tensor  # [sequences] int32: each context after the step
    query_start: Tensor  # [sequences + 1] int32: each sequence's first row in `rows`
    everything: bool  # the rows are all of T, in order

    @staticmethod
    def of(batch: StepBatch, seqs: list[int]) -> Rows | None:
        if not seqs:
            return None
        qs = batch.query_start
        longest = max(len(batch.block_tables[i]) for i in seqs)
        starts = [0]
        for i in seqs:
            starts.append(starts[-1] + qs[i + 1] - qs[i])
        return Rows(
            rows=torch.tensor(
                [r for i in seqs for r in range(qs[i], qs[i + 1])], dtype=torch.int64
            ),
            tables=torch.from_numpy(batch.padded_tables()[seqs, :longest]),
            lens=torch.tensor([batch.seq_lens[i] for i in seqs], dtype=torch.int32),
            query_start=torch.tensor(starts, dtype=torch.int32),
            everything=len(seqs) == batch.num_seqs,
        )


@dataclass
class CpuMetadata:
    full: AttentionMetadata  # the whole step, for SDPA when the kernels are not used
    decode: Rows | None  # sequences adding one token
    prefill: (
        Rows | None
    )  # sequences adding several (a prompt, or an append-prefill over cached tokens)
    prefill_sdpa: AttentionMetadata | None = (
        None  # the prefill sequences alone, for SDPA (bfloat16 on AMX)
    )


def prefill_in_sdpa(dtype: torch.dtype) -> bool:
    """Whether prefill rows of this dtype go to PyTorch's SDPA rather than our kernel: bfloat16
    where the CPU has AMX-BF16 (and PPD_CPU_ISA does not hide it)."""
    return dtype == torch.bfloat16 and "amx_bf16" in cpu_flags()


def only(meta: AttentionMetadata, seqs: list[int]) -> AttentionMetadata:
    """meta restricted to the sequences seqs (their rows concatenated in that order)."""
    starts = [0]
    for i in seqs:
        starts.append(starts[-1] + meta.query_start[i + 1] - meta.query_start[i])
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start=starts,
        context_lens=[meta.context_lens[i] for i in seqs],
        block_tables=[meta.block_tables[i] for i in seqs],
        block_size=meta.block_size,
    )


def refuse_fp8(k_cache: Tensor) -> None:
    """Raise the user's error for an fp8 pool, which neither our kernels nor the SDPA path beside
    them read."""
    if k_cache.dtype == FP8:
        raise ValueError(
            "the cpu attention backend does not read an fp8 KV cache (--kv-cache-dtype fp8): use "
            "--attention-backend torch (or triton on a GPU), or a KV cache of the model's dtype"
        )


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
        full = super().prepare(batch)
        return CpuMetadata(
            full=full,
            decode=Rows.of(batch, single),
            prefill=Rows.of(batch, several),
            prefill_sdpa=only(full, several) if several else None,
        )

    def rope_and_attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: CpuMetadata,
        scale: float,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> Tensor:
        """RoPE and the KV store in one kernel call (rope_store_kv), then attend; the unfused path
        where a tensor is not as the kernel reads it."""
        if (
            self.kernels is None
            or not q.dtype == k_cache.dtype == v_cache.dtype
            or not rope_takes(positions, cos, q, k, v)
        ):
            return super().rope_and_attend(
                q, k, v, k_cache, v_cache, meta, scale, positions, cos, sin, kv_scales=kv_scales
            )
        q = self.kernels.rope_store_kv(
            q, k, v, k_cache, v_cache, meta.full.slot_mapping, positions, cos, sin
        )
        return self.attend(q, k_cache, v_cache, meta, scale)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: CpuMetadata,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> Tensor:
        refuse_fp8(k_cache)
        store_kv(k, v, k_cache, v_cache, meta.full.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: CpuMetadata, scale: float
    ) -> Tensor:
        """Attention over the caches, the step's new keys and values already stored."""
        if (
            self.kernels is None
            or q.dtype not in DTYPES
            or q.dtype != k_cache.dtype
            or q.shape[1] // k_cache.shape[1] > MAX_GROUP
        ):
            return sdpa_attention(q, k_cache, v_cache, meta.full, scale)
        bs = meta.full.block_size

        def decode(x: Tensor) -> Tensor:
            rows = meta.decode
            return self.kernels.paged_decode(x, k_cache, v_cache, rows.tables, rows.lens, scale, bs)

        def prefill(x: Tensor) -> Tensor:
            if prefill_in_sdpa(x.dtype):
                return sdpa_attention(x, k_cache, v_cache, meta.prefill_sdpa, scale)
            rows = meta.prefill
            return self.kernels.paged_prefill(
                x, k_cache, v_cache, rows.tables, rows.lens, rows.query_start, scale, bs
            )

        parts = [
            (rows, fn)
            for rows, fn in ((meta.decode, decode), (meta.prefill, prefill))
            if rows is not None
        ]
        if len(parts) == 1 and parts[0][0].everything:
            return parts[0][1](q)
        out = torch.empty_like(q)
        for rows, fn in parts:
            out[rows.rows] = fn(q[rows.rows])
        return out
