"""Paged attention and the fused elementwise ops through our Triton kernels (engine/kernels/): the
GPU path.

prepare() stages the step's metadata (query offsets, context lengths, KV slots, block tables) in one
pinned host buffer and queues one copy of it to the device; the first layer plans the attention
launches and allocates the rotated-query and output buffers, which every later layer of the step
reuses. A layer then runs RoPE fused with the KV store, and the attention kernel: on its decode grid
for the step's leading sequences of one new token (ModelRunner.make_batch puts them first), which
may split each sequence's KV across programs (split-KV) so that small batches still fill the GPU; on
its general grid, with the tile of the longest query, for the rest (prompts, append-prefills,
chunks), where an append over a long cached prefix splits each query tile's KV the same way. A
decode row beside a long append so costs what it costs in a decode step, not a tile of the append's
height. A step with both runs the two grids as one launch (MIXED_LAUNCH "fused") or two
("sequential").

An fp8 KV pool (float8_e4m3fn under a model of another dtype) is written and read by the same
kernels, compiled for its dtype, with each layer's scales (engine/kernels/store_kv.py,
attention.py).

For CUDA graphs the metadata lives in static buffers sized for the largest bucket: a captured graph
reads them, and fill_graph_metadata rewrites them in place (through the same pinned staging) before
each replay.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, AttentionShape, GraphBucket, StepBatch
from engine.kernels import (
    add_rms_norm_,
    apply_rope,
    choose_append_splits,
    choose_num_splits,
    launch_attention,
    plan_attention,
    plan_mixed_attention,
    rms_norm,
    rope_store_kv,
    silu_and_mul,
    store_kv,
    workspace_for,
)
from engine.kernels import moe as moe_kernels
from engine.kernels.attention import AttentionLaunch, default_config, general_programs
from engine.kernels.fp8 import fp8_linear
from engine.kernels.launch import Launches
from engine.ops import Experts
from engine.quant import Fp8Weight
from engine.staging import Staging

# How a step with decodes and other sequences runs attention's two grids: "fused", one launch whose
# programs take either role, or "sequential", the decode grid's launch then the general grid's. Read
# once, at import. Sequential until a GPU has timed both (`ppd bench engine` times the other launch
# of its mixed step eagerly).
MIXED_LAUNCH = os.environ.get("PPD_MIXED_ATTENTION", "sequential")
if MIXED_LAUNCH not in ("fused", "sequential"):
    raise ValueError(
        f"PPD_MIXED_ATTENTION={MIXED_LAUNCH!r}: set it to 'fused' or 'sequential', or unset it"
    )


class TritonOps:
    """The fused kernels behind the Ops protocol, launched through the step's Launches (one per
    backend, renewed by each prepare and graph_view: after a step's first layer, a kernel is
    relaunched without the JIT); add_rms_norm works in place."""

    def __init__(self) -> None:
        self.launches = Launches()

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps, launches=self.launches)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        return add_rms_norm_(x, residual, weight, eps, self.launches)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return silu_and_mul(x, launches=self.launches)

    def route(self, logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
        return moe_kernels.route(logits, top_k, renormalize, launches=self.launches)

    def moe(self, x: Tensor, experts: Experts, weights: Tensor, ids: Tensor) -> Tensor:
        return moe_kernels.fused_moe(
            x, experts.w13, experts.w2, weights, ids, launches=self.launches
        )

    apply_rope = staticmethod(apply_rope)

    def linear(self, x: Tensor, weight: Tensor | Fp8Weight, bias: Tensor | None = None) -> Tensor:
        """cuBLAS; an FP8 weight through torch._scaled_mm or our FP8 GEMM (kernels/fp8.py)."""
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias, launches=self.launches)
        return torch.nn.functional.linear(x, weight, bias)


@dataclass
class TritonMetadata:
    slot_mapping: Tensor  # [T] int32, -1 for padding tokens
    query_start: Tensor  # [B+1] int32
    seq_lens: Tensor  # [B] int32, 0 for padding rows
    block_tables: Tensor  # [B, W] int32
    # sequence slots [0, num_decodes) run on the decode grid (one token at most), the rest on
    num_decodes: int
    # the general grid; slots past the decodes are padding of no token, for alignment
    decode_tokens: int  # the decode grid's rows: the step's first decode_tokens tokens
    max_query_len: (
        int  # the general grid's longest query (its tile); 1 when every sequence is a decode
    )
    num_splits: int  # the decode grid's KV splits
    workspace: tuple[Tensor, Tensor] | None = (
        None  # the decode grid's split-KV partials (graphs: static views)
    )
    max_seq_len: int = (
        0  # the general grid's longest sequence, keys included (its tile: default_config)
    )
    general_splits: int = 1  # the general grid's KV splits per query tile
    general_workspace: tuple[Tensor, Tensor] | None = (
        None  # its split-KV partials, rows indexed by token
    )
    # Set by the step's first layer and reused by the others (the model's dtype is not known to
    # prepare):
    attention: list[tuple[AttentionLaunch, Tensor, Tensor, Tensor]] | None = (
        None  # with query_start, seq_lens, tables
    )
    q_rot: Tensor | None = None  # [T, H, D] rotated queries
    out: Tensor | None = None  # [T, H, D] attention output


@dataclass
class GraphBuffers:
    """Static device buffers every captured graph of a set reads, sized for its largest bucket."""

    ints: Tensor  # int32 [query_start (S+1) | seq_lens (S) | slots (T)]
    block_tables: Tensor  # int32 [S, max blocks per sequence]
    workspace: Tensor  # flat float32 split-KV partials, viewed per bucket
    splits: dict[
        GraphBucket, int
    ]  # bucket -> the KV splits of its decode grid (decode bucket) or general grid
    max_seqs: int  # S: the most (padded) sequences of a bucket
    max_tokens: int  # T: the most tokens of a bucket


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, shape: AttentionShape, device: torch.device) -> None:
        super().__init__(shape, device)
        self.ops = TritonOps()
        # Off CUDA (Triton's interpreter, in tests) decide the splits as an H100 would.
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 132
        )
        self.staging = Staging(torch.int32, device)

    def prepare(self, batch: StepBatch) -> TritonMetadata:
        self.ops.launches = Launches()
        n, t = batch.num_seqs, len(batch.slot_mapping)
        max_query_len = batch.max_query_len
        d = n if max_query_len == 1 else batch.num_decodes
        # Decode slots padded to a 16-byte boundary where the general grid's sequences follow them.
        decodes = _align(d) if n > d else d
        lay = Layout.tight(decodes + n - d, decodes, t, batch.padded_tables().shape[1])
        host = self.staging.buffer(lay.size)
        lay.write(host, batch, d, t, decode_bucket=False)
        dev = self.staging.to_device()
        s = self.shape
        splits, workspace, general_splits, general_workspace = 1, None, 1, None
        if d:
            splits = choose_num_splits(d, s.num_kv_heads, max(batch.seq_lens[:d]), self.num_sms)
            if splits > 1:  # one workspace for all layers of the step
                workspace = workspace_for(d, s.num_heads, s.head_dim, splits, self.device)
        max_seq_len = max(batch.seq_lens[d:], default=0)
        if n > d:
            general_splits = self._general_splits(t - d, max_query_len, max_seq_len, self.num_sms)
            if general_splits > 1:
                general_workspace = workspace_for(
                    t, s.num_heads, s.head_dim, general_splits, self.device
                )
        return TritonMetadata(
            slot_mapping=dev[lay.slots_at : lay.slots_at + t],
            query_start=dev[: lay.seqs + 1],
            seq_lens=dev[lay.lens_at : lay.lens_at + lay.seqs],
            block_tables=dev[lay.tables_at : lay.size].view(lay.seqs, lay.width),
            num_decodes=decodes,
            decode_tokens=d,
            max_query_len=max_query_len,
            num_splits=splits,
            workspace=workspace,
            max_seq_len=max_seq_len,
            general_splits=general_splits,
            general_workspace=general_workspace,
        )

    def _general_splits(
        self, tokens: int, max_query_len: int, max_seq_len: int, num_sms: int
    ) -> int:
        """The general grid's KV splits over `tokens` tokens with the tile default_config gives
        it."""
        s = self.shape
        group = s.num_heads // s.num_kv_heads
        programs = general_programs(
            tokens, group, s.num_kv_heads, default_config(max_query_len, group, max_seq_len)
        )
        return choose_append_splits(programs, max_query_len, max_seq_len, num_sms)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: TritonMetadata,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        if meta.attention is None:
            self._plan(meta, q, k_cache, v_cache, scale)
        return self._attend(meta, q, k_cache, v_cache, kv_scales)

    def rope_and_attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: TritonMetadata,
        scale: float,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> Tensor:
        if meta.attention is None:  # the step's first layer
            t, h, d = q.shape
            assert k.shape == v.shape == (t, self.shape.num_kv_heads, d) and cos.shape[1] == d // 2
            assert q.stride(2) == k.stride(2) == v.stride(2) == cos.stride(1) == 1, (
                "last dims must be contiguous"
            )
            meta.q_rot = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
            self._plan(meta, meta.q_rot, k_cache, v_cache, scale)
        rope_store_kv(
            q,
            k,
            v,
            positions,
            cos,
            sin,
            k_cache,
            v_cache,
            meta.slot_mapping,
            out=meta.q_rot,
            launches=self.ops.launches,
            kv_scales=kv_scales,
        )
        return self._attend(meta, meta.q_rot, k_cache, v_cache, kv_scales)

    def _attend(
        self,
        meta: TritonMetadata,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        kv_scales: tuple[float, float],
    ) -> Tensor:
        for launch, query_start, seq_lens, tables in meta.attention:
            launch_attention(
                launch,
                meta.out,
                q,
                k_cache,
                v_cache,
                tables,
                query_start,
                seq_lens,
                self.ops.launches,
                kv_scales,
            )
        return meta.out

    def _plan(
        self, meta: TritonMetadata, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float
    ) -> None:
        """The step's first layer: check the layout every layer shares, allocate its output, plan
        attention (one launch per grid, or one for both: MIXED_LAUNCH) for queries of q's
        strides."""
        t, h, d = q.shape
        hkv = self.shape.num_kv_heads
        assert (h, d) == (self.shape.num_heads, self.shape.head_dim) and q.stride(2) == 1
        assert (
            k_cache.shape[1:] == (hkv, d)
            and k_cache.is_contiguous()
            and v_cache.stride() == k_cache.stride()
        )
        assert meta.block_tables.stride(1) == 1
        meta.out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
        common = dict(
            q_strides=q.stride()[:2],
            out_strides=(h * d, d),
            cache_strides=k_cache.stride()[:2],
            table_stride=meta.block_tables.stride(0),
            num_kv_heads=hkv,
            block_size=self.shape.block_size,
            scale=scale,
            device=q.device,
        )
        b, n = meta.seq_lens.shape[0], meta.num_decodes
        tile = dict(
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            num_splits=meta.general_splits,
            workspace=meta.general_workspace,
        )
        if n and b > n and MIXED_LAUNCH == "fused":
            mixed = plan_mixed_attention(
                t,
                h,
                d,
                b,
                q.dtype,
                num_decodes=n,
                decode_tokens=meta.decode_tokens,
                decode_splits=meta.num_splits,
                decode_workspace=meta.workspace,
                **tile,
                **common,
            )
            meta.attention = [(mixed, meta.query_start, meta.seq_lens, meta.block_tables)]
            return
        meta.attention = []
        if n:  # its rows are the step's first decode_tokens tokens (a padding decode slot has none)
            decode = plan_attention(
                meta.decode_tokens,
                h,
                d,
                n,
                q.dtype,
                max_query_len=1,
                num_splits=meta.num_splits,
                workspace=meta.workspace,
                **common,
            )
            meta.attention.append(
                (decode, meta.query_start[: n + 1], meta.seq_lens[:n], meta.block_tables[:n])
            )
        if (
            b > n
        ):  # its rows follow the decodes' (a token bucket's graph: from row 0 on, see graph_view)
            general = plan_attention(
                t, h, d, b - n, q.dtype, first_token=meta.decode_tokens, **tile, **common
            )
            meta.attention.append(
                (general, meta.query_start[n:], meta.seq_lens[n:], meta.block_tables[n:])
            )

    # ---- CUDA graphs -----------------------------------------------------------------------------

    def _graph_sizes(
        self, buckets: list[GraphBucket], num_sms: int | None
    ) -> tuple[dict, int, Layout]:
        """Each bucket's KV splits, the split partials' rows, and the layout of the static int
        buffer."""
        s, sms = self.shape, num_sms or self.num_sms
        # Captured graphs assume the longest context: a short sequence's extra splits exit at once
        # on the device.
        longest = s.max_blocks_per_seq * s.block_size
        splits = {
            bk: choose_num_splits(bk.seqs, s.num_kv_heads, longest, sms)
            if bk.decode
            else self._general_splits(bk.tokens, bk.max_query_len, longest, sms)
            for bk in buckets
        }
        partials = max([bk.tokens * n for bk, n in splits.items() if n > 1] + [0]) * s.num_heads
        lay = Layout.tight(
            max(sum(slots(bk)) for bk in buckets), 0, max(bk.tokens for bk in buckets), 0
        )
        return splits, partials, lay

    def graph_metadata_bytes(self, buckets: list[GraphBucket], num_sms: int | None = None) -> int:
        _, partials, lay = self._graph_sizes(buckets, num_sms)
        return 4 * (
            lay.size
            + lay.seqs * self.shape.max_blocks_per_seq
            + partials * (self.shape.head_dim + 1)
        )

    def graph_metadata(
        self, buckets: list[GraphBucket], num_sms: int | None = None
    ) -> GraphBuffers:
        s, dev = self.shape, self.device
        splits, partials, lay = self._graph_sizes(buckets, num_sms)
        # Until the first fill, no sequence has a token or a context and no token a KV slot: the
        # capture's steps read nothing and write nothing (a slot of 0 would be a store into the
        # pool).
        ints = torch.zeros(lay.size, dtype=torch.int32, device=dev)
        ints[lay.slots_at :] = -1
        return GraphBuffers(
            ints=ints,
            block_tables=torch.zeros(lay.seqs, s.max_blocks_per_seq, dtype=torch.int32, device=dev),
            workspace=torch.empty(partials * (s.head_dim + 1), dtype=torch.float32, device=dev),
            splits=splits,
            max_seqs=lay.seqs,
            max_tokens=lay.tokens,
        )

    def _graph_layout(self, static: GraphBuffers, bucket: GraphBucket, width: int) -> Layout:
        """Bucket's slots at the static buffer's region offsets (its tables in the host buffer after
        its slots)."""
        big = Layout.tight(static.max_seqs, 0, static.max_tokens, 0)
        decodes, others = slots(bucket)
        return Layout(
            decodes + others, decodes, bucket.tokens, width, big.lens_at, big.slots_at, big.size
        )

    def graph_view(self, static: GraphBuffers, bucket: GraphBucket) -> TritonMetadata:
        self.ops.launches = Launches()
        s, lay = self.shape, self._graph_layout(static, bucket, 0)
        n = static.splits[bucket]
        workspace = None
        if n > 1:
            rows = bucket.tokens * s.num_heads * n
            out = static.workspace[: rows * s.head_dim].view(
                bucket.tokens, s.num_heads, n, s.head_dim
            )
            lse = static.workspace[rows * s.head_dim : rows * (s.head_dim + 1)].view(
                bucket.tokens, s.num_heads, n
            )
            workspace = (out, lse)
        ints, decode = static.ints, bucket.decode
        # A token bucket's decodes do not split: its decode rows' count is known only on the device,
        # so its general grid merges from row 0 on (decode_tokens 0) and skips the rows before its
        # first sequence's.
        return TritonMetadata(
            ints[lay.slots_at : lay.slots_at + bucket.tokens],
            ints[: lay.seqs + 1],
            ints[lay.lens_at : lay.lens_at + lay.seqs],
            static.block_tables[: lay.seqs],
            num_decodes=lay.decodes,
            decode_tokens=lay.decodes if decode else 0,
            max_query_len=bucket.max_query_len,
            num_splits=n if decode else 1,
            workspace=workspace if decode else None,
            # A token bucket keeps one tile and split count, those of an append over the longest
            # context: it holds appends beside decodes; a short prompt's splits past its keys are
            # empty.
            max_seq_len=s.max_blocks_per_seq * s.block_size,
            general_splits=1 if decode else n,
            general_workspace=None if decode else workspace,
        )

    def fill_graph_metadata(
        self, static: GraphBuffers, batch: StepBatch, bucket: GraphBucket
    ) -> None:
        n = batch.num_seqs
        d = n if batch.max_query_len == 1 else batch.num_decodes
        width = batch.padded_tables().shape[1]
        assert width <= static.block_tables.shape[1], "block table longer than max_model_len allows"
        lay = self._graph_layout(static, bucket, width)
        assert d <= lay.decodes and n - d <= max(lay.seqs - lay.decodes - 1, 0), (
            "the batch does not fit the bucket"
        )
        host = self.staging.buffer(lay.size)
        lay.write(host, batch, d, bucket.tokens, bucket.decode)
        used = lay.decodes + n - d if n > d else d
        self.staging.to_device(static.ints, 0, lay.tables_at)
        self.staging.to_device(
            static.block_tables[:used, :width], lay.tables_at, lay.tables_at + used * width
        )


def slots(bucket: GraphBucket) -> tuple[int, int]:
    """A bucket's sequence slots: (decode slots, other slots). A token bucket of t tokens holds up
    to bucket.seqs decodes (their slots padded to a 16-byte boundary), or up to t // 2 sequences
    of two tokens or more, and has one spare slot for the padding tokens."""
    if bucket.decode:
        return bucket.seqs, 0
    return _align(bucket.seqs), min(bucket.seqs, bucket.tokens // 2) + 1


def _align(n: int) -> int:
    """int32 elements up to the next 16-byte boundary: Triton specializes a kernel on its pointers'
    16-byte alignment, and Launches relaunches only aligned tensors."""
    return -(-n // 4) * 4


@dataclass(frozen=True)
class Layout:
    """Where a step's int32 metadata lies in one host buffer, each region 16-byte aligned:
    query_start of `seqs` sequence slots (+1), seq_lens, the KV slots of `tokens` tokens, then
    block tables of `seqs` rows of `width`. Slots [0, decodes) run on the decode grid, the rest
    on the general grid; padding slots have no context."""

    seqs: int
    decodes: int
    tokens: int
    width: int
    lens_at: int
    slots_at: int
    tables_at: int

    @classmethod
    def tight(cls, seqs: int, decodes: int, tokens: int, width: int) -> Layout:
        lens_at = _align(seqs + 1)
        slots_at = lens_at + _align(seqs)
        return cls(seqs, decodes, tokens, width, lens_at, slots_at, slots_at + _align(tokens))

    @property
    def size(self) -> int:
        return self.tables_at + self.seqs * self.width

    def write(self, host, batch: StepBatch, d: int, tokens: int, decode_bucket: bool) -> None:
        """Lay out batch (its first d sequences its decodes) padded to `tokens` tokens. A decode
        bucket's padding slots each own one padding token; otherwise padding decode slots own no
        token, and the general grid's last slot (a token bucket's spare) owns every padding token,
        so the two grids' sequences stay in token order and every row of the output is written
        (zeros for padding). Table rows past the step's longest table, and padding slots' rows, are
        left as they are: the kernel reads a sequence's table only up to its context."""
        n, t, qs = batch.num_seqs, len(batch.token_ids), batch.query_start
        g = n - d
        starts, lens = host[: self.seqs + 1], host[self.lens_at : self.lens_at + self.seqs]
        starts[: d + 1] = qs[: d + 1]
        starts[d + 1 : self.decodes + 1] = range(d + 1, self.decodes + 1) if decode_bucket else d
        lens[:d] = batch.seq_lens[:d]
        lens[d : self.decodes] = 0
        if self.seqs > self.decodes:
            starts[self.decodes : self.decodes + g + 1] = qs[d:]
            starts[self.decodes + g + 1 :] = tokens
            lens[self.decodes : self.decodes + g] = batch.seq_lens[d:]
            lens[self.decodes + g :] = 0
        host[self.slots_at : self.slots_at + t] = batch.slot_mapping
        host[self.slots_at + t : self.slots_at + tokens] = -1
        rows = host[self.tables_at : self.size].reshape(self.seqs, self.width)
        tables = batch.padded_tables()
        rows[:d, : tables.shape[1]] = tables[:d]
        rows[self.decodes : self.decodes + g, : tables.shape[1]] = tables[d:]
