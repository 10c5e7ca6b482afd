"""Paged attention and the fused elementwise ops through our Triton kernels (engine/kernels/): the GPU path.

prepare() stages the step's metadata (query offsets, context lengths, KV slots, block tables) in one pinned host
buffer and queues one copy of it to the device; the first layer plans the attention launch and allocates the
rotated-query and output buffers, which every later layer of the step reuses. A layer then runs two kernels
around its GEMMs' attention: RoPE fused with the KV store, and the one attention kernel that serves prefill,
append-prefill and decode alike. Decode-only batches may split each sequence's KV across programs (split-KV) so
that small batches still fill the GPU.

For CUDA graphs the metadata lives in static buffers sized for the largest bucket: a captured graph reads them,
and fill_graph_metadata rewrites them in place (through the same pinned staging) before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, AttentionShape, GraphBucket, StepBatch
from engine.kernels import (add_rms_norm_, apply_rope, choose_num_splits, launch_attention, paged_attention,
                            plan_attention, rms_norm, rope_store_kv, silu_and_mul, store_kv, workspace_for)
from engine.kernels.attention import AttentionLaunch
from engine.staging import Staging


class TritonOps:
    """The fused kernels behind the Ops protocol; add_rms_norm works in place."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm_)
    apply_rope = staticmethod(apply_rope)
    silu_and_mul = staticmethod(silu_and_mul)
    linear = staticmethod(torch.nn.functional.linear)  # cuBLAS


@dataclass
class TritonMetadata:
    slot_mapping: Tensor   # [T] int32, -1 for padding tokens
    query_start: Tensor    # [B+1] int32
    seq_lens: Tensor       # [B] int32, 0 for padding rows
    block_tables: Tensor   # [B, W] int32
    max_query_len: int
    num_splits: int
    workspace: tuple[Tensor, Tensor] | None = None  # split-KV partials, preallocated for graphs
    # Set by the step's first layer and reused by the others (the model's dtype is not known to prepare):
    launch: AttentionLaunch | None = None
    q_rot: Tensor | None = None  # [T, H, D] rotated queries
    out: Tensor | None = None    # [T, H, D] attention output


@dataclass
class GraphBuffers:
    """Static device buffers every captured graph of a set reads, sized for its largest bucket."""

    ints: Tensor                     # int32 [query_start (S+1) | seq_lens (S) | slots (T)]
    block_tables: Tensor             # int32 [S, max blocks per sequence]
    workspace: Tensor                # flat float32 split-KV partials, viewed per decode bucket
    splits: dict[GraphBucket, int]   # decode bucket -> the KV splits it is captured with
    max_seqs: int                    # S: the most (padded) sequences of a bucket
    max_tokens: int                  # T: the most tokens of a bucket


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    ops = TritonOps()

    def __init__(self, shape: AttentionShape, device: torch.device) -> None:
        super().__init__(shape, device)
        # Off CUDA (Triton's interpreter, in tests) decide the splits as an H100 would.
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.staging = Staging(torch.int32, device)

    def prepare(self, batch: StepBatch) -> TritonMetadata:
        b, t = batch.num_seqs, len(batch.slot_mapping)
        width = max(len(table) for table in batch.block_tables)
        host = self.staging.buffer(2 * b + 1 + t + b * width)
        host[: b + 1] = batch.query_start
        host[b + 1 : 2 * b + 1] = batch.seq_lens
        host[2 * b + 1 : 2 * b + 1 + t] = batch.slot_mapping
        _fill_tables(host[2 * b + 1 + t :].reshape(b, width), batch.block_tables)
        dev = self.staging.to_device()
        max_query_len = batch.max_query_len
        splits, workspace = 1, None
        if max_query_len == 1:
            splits = choose_num_splits(b, self.shape.num_kv_heads, max(batch.seq_lens), self.num_sms)
            if splits > 1:  # one workspace for all layers of the step
                workspace = workspace_for(b, self.shape.num_heads, self.shape.head_dim, splits, self.device)
        return TritonMetadata(
            slot_mapping=dev[2 * b + 1 : 2 * b + 1 + t], query_start=dev[: b + 1], seq_lens=dev[b + 1 : 2 * b + 1],
            block_tables=dev[2 * b + 1 + t :].view(b, width), max_query_len=max_query_len, num_splits=splits,
            workspace=workspace)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: TritonMetadata,
                scale: float) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                               block_size=self.shape.block_size, scale=scale, max_query_len=meta.max_query_len,
                               num_splits=meta.num_splits, workspace=meta.workspace)

    def rope_and_attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                        meta: TritonMetadata, scale: float, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if meta.launch is None:
            self._plan(meta, q, k, v, k_cache, v_cache, scale, cos)
        rope_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, meta.slot_mapping, out=meta.q_rot)
        return launch_attention(meta.launch, meta.out, meta.q_rot, k_cache, v_cache, meta.block_tables,
                                meta.query_start, meta.seq_lens)

    def _plan(self, meta: TritonMetadata, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
              scale: float, cos: Tensor) -> None:
        """The step's first layer: check the layout every layer shares, allocate the step's buffers, plan attention."""
        t, h, d = q.shape
        hkv = self.shape.num_kv_heads
        assert (h, d) == (self.shape.num_heads, self.shape.head_dim) and k.shape == v.shape == (t, hkv, d)
        assert q.stride(2) == k.stride(2) == v.stride(2) == cos.stride(1) == 1, "last dims must be contiguous"
        assert k_cache.shape[1:] == (hkv, d) and k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
        assert meta.block_tables.stride(1) == 1 and cos.shape[1] == d // 2
        meta.q_rot = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
        meta.out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
        meta.launch = plan_attention(
            t, h, d, meta.seq_lens.shape[0], q.dtype, q_strides=(h * d, d), out_strides=(h * d, d),
            cache_strides=k_cache.stride()[:2], table_stride=meta.block_tables.stride(0), num_kv_heads=hkv,
            block_size=self.shape.block_size, scale=scale, max_query_len=meta.max_query_len,
            num_splits=meta.num_splits, workspace=meta.workspace, device=q.device)

    # ---- CUDA graphs -------------------------------------------------------------------------------------

    def graph_metadata(self, buckets: list[GraphBucket], num_sms: int | None = None) -> GraphBuffers:
        s, dev = self.shape, self.device
        # Captured graphs assume the longest context: a short sequence's extra splits exit at once on the device.
        splits = {bk: choose_num_splits(bk.seqs, s.num_kv_heads, s.max_blocks_per_seq * s.block_size,
                                        num_sms or self.num_sms) for bk in buckets if bk.decode}
        partials = max([bk.tokens * n for bk, n in splits.items()] + [0]) * s.num_heads
        max_seqs, max_tokens = max(padded_seqs(bk) for bk in buckets), max(bk.tokens for bk in buckets)
        # Until the first fill, no sequence has a token or a context and no token a KV slot: the capture's steps
        # read nothing and write nothing (a slot of 0 would be a store into the pool).
        ints = torch.zeros(2 * max_seqs + 1 + max_tokens, dtype=torch.int32, device=dev)
        ints[2 * max_seqs + 1 :] = -1
        return GraphBuffers(
            ints=ints,
            block_tables=torch.zeros(max_seqs, s.max_blocks_per_seq, dtype=torch.int32, device=dev),
            workspace=torch.empty(partials * (s.head_dim + 1), dtype=torch.float32, device=dev),
            splits=splits, max_seqs=max_seqs, max_tokens=max_tokens)

    def graph_view(self, static: GraphBuffers, bucket: GraphBucket) -> TritonMetadata:
        s, big_s = self.shape, static.max_seqs
        b, n = padded_seqs(bucket), static.splits.get(bucket, 1)
        workspace = None
        if n > 1:
            rows = bucket.tokens * s.num_heads * n
            out = static.workspace[: rows * s.head_dim].view(bucket.tokens, s.num_heads, n, s.head_dim)
            lse = static.workspace[rows * s.head_dim : rows * (s.head_dim + 1)].view(bucket.tokens, s.num_heads, n)
            workspace = (out, lse)
        ints = static.ints
        return TritonMetadata(ints[2 * big_s + 1 : 2 * big_s + 1 + bucket.tokens], ints[: b + 1],
                              ints[big_s + 1 : big_s + 1 + b], static.block_tables[:b],
                              max_query_len=bucket.max_query_len, num_splits=n, workspace=workspace)

    def fill_graph_metadata(self, static: GraphBuffers, batch: StepBatch, bucket: GraphBucket) -> None:
        big_s, big_t = static.max_seqs, static.max_tokens
        n, t, b = batch.num_seqs, len(batch.token_ids), padded_seqs(bucket)
        width = max(len(table) for table in batch.block_tables)
        assert width <= static.block_tables.shape[1], "block table longer than max_model_len allows"
        head = 2 * big_s + 1 + big_t
        host = self.staging.buffer(head + b * width)
        host[: n + 1] = batch.query_start
        # Padding sequences have no context. In a decode bucket each owns one padding token; otherwise the first
        # owns every padding token and the others none. Either way every row of the output is written (zeros).
        host[n + 1 : b + 1] = range(n + 1, b + 1) if bucket.decode else bucket.tokens
        host[big_s + 1 : big_s + 1 + n] = batch.seq_lens
        host[big_s + 1 + n : big_s + 1 + b] = 0
        host[2 * big_s + 1 : 2 * big_s + 1 + t] = batch.slot_mapping
        host[2 * big_s + 1 + t : 2 * big_s + 1 + bucket.tokens] = -1
        # Table rows past a sequence's blocks, and padding rows, are left as they are: the kernel reads a
        # sequence's table only up to its context, and a padding sequence has none.
        _fill_tables(host[head:].reshape(b, width)[:n], batch.block_tables)
        self.staging.to_device(static.ints, 0, head)
        self.staging.to_device(static.block_tables[:n, :width], head, head + n * width)


def padded_seqs(bucket: GraphBucket) -> int:
    """Sequences a bucket's graph runs: its own, plus one for the padding tokens of a non-decode bucket."""
    return bucket.seqs if bucket.decode else bucket.seqs + 1


def _fill_tables(rows, tables: list[list[int]]) -> None:
    """Copy each block table into its row of a [B, width] int32 array (entries past a table are left as they are)."""
    for row, table in zip(rows, tables):
        row[: len(table)] = table
