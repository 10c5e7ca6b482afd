"""Paged attention and the fused elementwise ops through our Triton kernels (engine/kernels/): the GPU path.

prepare() stages the step's metadata (query offsets, context lengths, KV slots, block tables) in one pinned host
buffer and queues one copy of it to the device; the first layer plans the attention launches and allocates the
rotated-query and output buffers, which every later layer of the step reuses. A layer then runs RoPE fused with
the KV store, and the attention kernel: on its decode grid for the step's leading sequences of one new token
(ModelRunner.make_batch puts them first), which may split each sequence's KV across programs (split-KV) so that
small batches still fill the GPU; on its general grid, with the tile of the longest query, for the rest
(prompts, append-prefills, chunks). A decode row beside a long append so costs what it costs in a decode step,
not a tile of the append's height.

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
    num_decodes: int       # sequences [0, num_decodes) run on the decode grid (one token each), the rest on the general
    max_query_len: int     # the general grid's longest query (its tile); 1 when every sequence is a decode
    num_splits: int        # the decode grid's KV splits
    workspace: tuple[Tensor, Tensor] | None = None  # split-KV partials, preallocated for graphs
    # Set by the step's first layer and reused by the others (the model's dtype is not known to prepare):
    launches: list[tuple[AttentionLaunch, Tensor, Tensor, Tensor]] | None = None  # with query_start, seq_lens, tables
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
        d = b if max_query_len == 1 else batch.num_decodes
        splits, workspace = 1, None
        if d:
            splits = choose_num_splits(d, self.shape.num_kv_heads, max(batch.seq_lens[:d]), self.num_sms)
            if splits > 1:  # one workspace for all layers of the step
                workspace = workspace_for(d, self.shape.num_heads, self.shape.head_dim, splits, self.device)
        return TritonMetadata(
            slot_mapping=dev[2 * b + 1 : 2 * b + 1 + t], query_start=dev[: b + 1], seq_lens=dev[b + 1 : 2 * b + 1],
            block_tables=dev[2 * b + 1 + t :].view(b, width), num_decodes=d, max_query_len=max_query_len,
            num_splits=splits, workspace=workspace)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: TritonMetadata,
                scale: float) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                               block_size=self.shape.block_size, scale=scale, max_query_len=meta.max_query_len,
                               num_splits=meta.num_splits, workspace=meta.workspace)

    def rope_and_attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                        meta: TritonMetadata, scale: float, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if meta.launches is None:
            self._plan(meta, q, k, v, k_cache, v_cache, scale, cos)
        rope_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, meta.slot_mapping, out=meta.q_rot)
        for launch, query_start, seq_lens, tables in meta.launches:
            launch_attention(launch, meta.out, meta.q_rot, k_cache, v_cache, tables, query_start, seq_lens)
        return meta.out

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
        common = dict(q_strides=(h * d, d), out_strides=(h * d, d), cache_strides=k_cache.stride()[:2],
                      table_stride=meta.block_tables.stride(0), num_kv_heads=hkv, block_size=self.shape.block_size,
                      scale=scale, device=q.device)
        b, n = meta.seq_lens.shape[0], meta.num_decodes
        meta.launches = []
        if n:  # its rows are the step's first n tokens (a padding decode slot of a token bucket has none)
            decode = plan_attention(n, h, d, n, q.dtype, max_query_len=1, num_splits=meta.num_splits,
                                    workspace=meta.workspace, **common)
            meta.launches.append((decode, meta.query_start[: n + 1], meta.seq_lens[:n], meta.block_tables[:n]))
        if b > n:
            general = plan_attention(t, h, d, b - n, q.dtype, max_query_len=meta.max_query_len, **common)
            meta.launches.append((general, meta.query_start[n:], meta.seq_lens[n:], meta.block_tables[n:]))

    # ---- CUDA graphs -------------------------------------------------------------------------------------

    def graph_metadata(self, buckets: list[GraphBucket], num_sms: int | None = None) -> GraphBuffers:
        s, dev = self.shape, self.device
        # Captured graphs assume the longest context: a short sequence's extra splits exit at once on the device.
        splits = {bk: choose_num_splits(bk.seqs, s.num_kv_heads, s.max_blocks_per_seq * s.block_size,
                                        num_sms or self.num_sms) for bk in buckets if bk.decode}
        partials = max([bk.tokens * n for bk, n in splits.items()] + [0]) * s.num_heads
        max_seqs, max_tokens = max(sum(slots(bk)) for bk in buckets), max(bk.tokens for bk in buckets)
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
        decodes, others = slots(bucket)
        b, n = decodes + others, static.splits.get(bucket, 1)
        workspace = None
        if n > 1:
            rows = bucket.tokens * s.num_heads * n
            out = static.workspace[: rows * s.head_dim].view(bucket.tokens, s.num_heads, n, s.head_dim)
            lse = static.workspace[rows * s.head_dim : rows * (s.head_dim + 1)].view(bucket.tokens, s.num_heads, n)
            workspace = (out, lse)
        ints = static.ints
        return TritonMetadata(ints[2 * big_s + 1 : 2 * big_s + 1 + bucket.tokens], ints[: b + 1],
                              ints[big_s + 1 : big_s + 1 + b], static.block_tables[:b], num_decodes=decodes,
                              max_query_len=bucket.max_query_len, num_splits=n, workspace=workspace)

    def fill_graph_metadata(self, static: GraphBuffers, batch: StepBatch, bucket: GraphBucket) -> None:
        """The bucket's sequence slots: decode slots, then (a token bucket) the slots of the other sequences and a
        spare. Padding slots have no context. A decode bucket's each own one padding token; in a token bucket the
        padding decode slots own no token and the spare owns every padding token, so the two grids' sequences stay
        in token order and every row of the output is written (zeros for padding)."""
        big_s, big_t = static.max_seqs, static.max_tokens
        n, t, qs = batch.num_seqs, len(batch.token_ids), batch.query_start
        d = n if batch.max_query_len == 1 else batch.num_decodes
        decodes, others = slots(bucket)
        width = max(len(table) for table in batch.block_tables)
        assert width <= static.block_tables.shape[1], "block table longer than max_model_len allows"
        assert d <= decodes and n - d <= max(others - 1, 0), "the batch does not fit the bucket"
        head = 2 * big_s + 1 + big_t
        host = self.staging.buffer(head + (decodes + others) * width)
        starts, lens = host[: big_s + 1], host[big_s + 1 : 2 * big_s + 1]
        starts[: d + 1] = qs[: d + 1]
        starts[d + 1 : decodes + 1] = range(d + 1, decodes + 1) if bucket.decode else d
        lens[:d] = batch.seq_lens[:d]
        lens[d:decodes] = 0
        if others:
            starts[decodes : decodes + n - d + 1] = qs[d:]
            starts[decodes + n - d + 1 : decodes + others + 1] = bucket.tokens
            lens[decodes : decodes + n - d] = batch.seq_lens[d:]
            lens[decodes + n - d : decodes + others] = 0
        host[2 * big_s + 1 : 2 * big_s + 1 + t] = batch.slot_mapping
        host[2 * big_s + 1 + t : 2 * big_s + 1 + bucket.tokens] = -1
        # Table rows past a sequence's blocks, and padding slots' rows, are left as they are: the kernel reads a
        # sequence's table only up to its context, and a padding slot has none.
        rows = host[head:].reshape(decodes + others, width)
        _fill_tables(rows[:d], batch.block_tables[:d])
        _fill_tables(rows[decodes:], batch.block_tables[d:])
        used = decodes + n - d if n > d else d
        self.staging.to_device(static.ints, 0, head)
        self.staging.to_device(static.block_tables[:used, :width], head, head + used * width)


def slots(bucket: GraphBucket) -> tuple[int, int]:
    """A bucket's sequence slots: (decode slots, other slots). A token bucket of t tokens holds up to bucket.seqs
    decodes, or up to t // 2 sequences of two tokens or more, and has one spare slot for the padding tokens."""
    if bucket.decode:
        return bucket.seqs, 0
    return bucket.seqs, min(bucket.seqs, bucket.tokens // 2) + 1


def _fill_tables(rows, tables: list[list[int]]) -> None:
    """Copy each block table into its row of a [B, width] int32 array (entries past a table are left as they are)."""
    for row, table in zip(rows, tables):
        row[: len(table)] = table
