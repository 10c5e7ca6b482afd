"""Paged attention and the fused elementwise ops through our Triton kernels (engine/kernels/): the GPU path.

prepare() moves the step's metadata to the device in one copy per tensor kind;
forward() stores the new K/V, then runs the one attention kernel that serves
prefill, append-prefill and decode alike. Decode-only batches may split each
sequence's KV across programs (split-KV) so that small batches still fill the
GPU. For CUDA graphs the metadata lives in static buffers sized for the largest
batch: a captured graph reads them, and fill_graph_metadata rewrites them in
place (through pinned host staging buffers) before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, AttentionShape, StepBatch
from engine.kernels import (add_rms_norm, apply_rope, choose_num_splits, paged_attention, rms_norm, silu_and_mul,
                            store_kv, workspace_for)


class TritonOps:
    """The fused kernels behind the Ops protocol."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    apply_rope = staticmethod(apply_rope)
    silu_and_mul = staticmethod(silu_and_mul)
    linear = staticmethod(torch.nn.functional.linear)  # cuBLAS


@dataclass
class TritonMetadata:
    slot_mapping: Tensor   # [T] int64, -1 for padding rows
    query_start: Tensor    # [B+1] int32
    seq_lens: Tensor       # [B] int32, 0 for padding rows
    block_tables: Tensor   # [B, W] int32
    max_query_len: int
    num_splits: int
    workspace: tuple[Tensor, Tensor] | None = None  # split-KV partials, preallocated for graphs


@dataclass
class GraphBuffers:
    """Static device buffers every captured decode graph reads, and their pinned host staging twins."""

    meta: TritonMetadata            # full-size views: [max_batch] rows
    workspace: Tensor               # flat float32 split-KV partials, viewed per batch size
    host_slots: Tensor              # pinned [max_batch] int64
    host_ints: Tensor               # pinned [max_batch * (1 + max_blocks)] int32: seq_lens then block tables
    splits: dict[int, int]          # batch size -> num_splits it was captured with


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    ops = TritonOps()

    def __init__(self, shape: AttentionShape, device: torch.device) -> None:
        super().__init__(shape, device)
        # Off CUDA (Triton's interpreter, in tests) decide the splits as an H100 would.
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132

    def prepare(self, batch: StepBatch) -> TritonMetadata:
        b, width = batch.num_seqs, max(len(t) for t in batch.block_tables)
        ints = np.zeros(2 * b + 1 + b * width, dtype=np.int32)
        ints[: b + 1] = batch.query_start
        ints[b + 1 : 2 * b + 1] = batch.seq_lens
        tables = ints[2 * b + 1 :].reshape(b, width)
        for i, table in enumerate(batch.block_tables):
            tables[i, : len(table)] = table
        dev = torch.from_numpy(ints).to(self.device, non_blocking=True)
        max_query_len = batch.max_query_len
        splits, workspace = 1, None
        if max_query_len == 1:
            splits = choose_num_splits(b, self.shape.num_kv_heads, max(batch.seq_lens), self.num_sms)
            if splits > 1:  # one workspace for all layers of the step
                workspace = workspace_for(b, self.shape.num_heads, self.shape.head_dim, splits, self.device)
        return TritonMetadata(
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=self.device),
            query_start=dev[: b + 1], seq_lens=dev[b + 1 : 2 * b + 1], block_tables=dev[2 * b + 1 :].view(b, width),
            max_query_len=max_query_len, num_splits=splits, workspace=workspace)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: TritonMetadata,
                scale: float) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                               block_size=self.shape.block_size, scale=scale, max_query_len=meta.max_query_len,
                               num_splits=meta.num_splits, workspace=meta.workspace)

    # ---- CUDA graphs -------------------------------------------------------------------------------------

    def graph_metadata(self, max_batch: int) -> GraphBuffers:
        s, dev = self.shape, self.device
        # Captured graphs assume the longest context: a short sequence's extra splits exit at once on the device.
        splits = {bs: choose_num_splits(bs, s.num_kv_heads, s.max_blocks_per_seq * s.block_size, self.num_sms)
                  for bs in range(1, max_batch + 1)}
        partials = max(bs * n for bs, n in splits.items()) * s.num_heads
        meta = TritonMetadata(
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=dev),
            query_start=torch.arange(max_batch + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(max_batch, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(max_batch, s.max_blocks_per_seq, dtype=torch.int32, device=dev),
            max_query_len=1, num_splits=1)
        pin = dev.type == "cuda"
        return GraphBuffers(
            meta=meta,
            workspace=torch.empty(partials * (s.head_dim + 1), dtype=torch.float32, device=dev),
            host_slots=torch.empty(max_batch, dtype=torch.int64, pin_memory=pin),
            host_ints=torch.empty(max_batch * (1 + s.max_blocks_per_seq), dtype=torch.int32, pin_memory=pin),
            splits=splits)

    def graph_view(self, static: GraphBuffers, batch_size: int) -> TritonMetadata:
        s, m, n = self.shape, static.meta, static.splits[batch_size]
        workspace = None
        if n > 1:
            rows = batch_size * s.num_heads * n
            out = static.workspace[: rows * s.head_dim].view(batch_size, s.num_heads, n, s.head_dim)
            lse = static.workspace[rows * s.head_dim : rows * (s.head_dim + 1)].view(batch_size, s.num_heads, n)
            workspace = (out, lse)
        return TritonMetadata(m.slot_mapping[:batch_size], m.query_start[: batch_size + 1], m.seq_lens[:batch_size],
                              m.block_tables[:batch_size], max_query_len=1, num_splits=n, workspace=workspace)

    def fill_graph_metadata(self, static: GraphBuffers, batch: StepBatch, batch_size: int) -> None:
        n, w = batch.num_seqs, static.meta.block_tables.shape[1]
        slots = static.host_slots.numpy()
        slots[:n] = batch.slot_mapping
        slots[n:batch_size] = -1
        ints = static.host_ints.numpy()
        ints[:n] = batch.seq_lens
        ints[n:batch_size] = 0
        width = max(len(t) for t in batch.block_tables)
        tables = ints[batch_size : batch_size + batch_size * width].reshape(batch_size, width)
        for i, table in enumerate(batch.block_tables):
            tables[i, : len(table)] = table
        # Entries past a row's used blocks are stale, and padding rows keep old tables: the kernel reads a
        # sequence's table only up to its seq_len, and a padding row's seq_len is 0.
        m = static.meta
        m.slot_mapping[:batch_size].copy_(static.host_slots[:batch_size], non_blocking=True)
        m.seq_lens[:batch_size].copy_(static.host_ints[:batch_size], non_blocking=True)
        assert width <= w, "block table longer than max_model_len allows"
        m.block_tables[:batch_size, :width].copy_(
            static.host_ints[batch_size : batch_size + batch_size * width].view(batch_size, width), non_blocking=True)
