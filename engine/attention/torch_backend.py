"""Paged attention in plain PyTorch: the CPU path, and the reference every fused kernel is tested
against.

An fp8 (e4m3) pool holds each key as x / k_scale, clamped to e4m3's finite range (a cast alone makes
NaN past it), and is read as stored * k_scale (values likewise with v_scale). The quotient is the
float32 product with the scale's float32 reciprocal: the same bits in every kernel and on every
device (PyTorch divides by a scalar that way on CUDA, not on the CPU). A pool of any other dtype is
cast to and from, its scales 1."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.attention.base import AttentionBackend, StepBatch
from engine.ops import TorchOps
from engine.quant import FP8, FP8_MAX


@dataclass
class AttentionMetadata:
    """Per-step attention inputs for a batch of sequences whose new tokens are concatenated."""

    slot_mapping: (
        Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) of each new token
    )
    query_start: list[
        int
    ]  # B+1 cumulative offsets of each sequence's new tokens in the T dimension
    context_lens: list[int]  # B: each sequence's KV length after this step (cached + new tokens)
    block_tables: list[list[int]]  # B: block ids of each sequence, in order
    block_size: int
    # Built on first use and shared by all layers of the step: the same for every layer.
    _gather: _KVGather | None = field(default=None, init=False, repr=False, compare=False)

    def kv_gather(self, device: torch.device) -> _KVGather:
        """The blocks holding every sequence's context, and its causal masks; built once per
        step."""
        if self._gather is None:
            self._gather = _KVGather.build(self, device)
        return self._gather


@dataclass
class _KVGather:
    blocks: Tensor  # the blocks covering each sequence's context, sequences concatenated
    kv_start: list[int]  # B: row of each sequence's first key among the gathered blocks' slots
    masks: list[
        Tensor | None
    ]  # None: no mask needed (decode, or full prefill which uses is_causal)

    @staticmethod
    def build(meta: AttentionMetadata, device: torch.device) -> _KVGather:
        bs = meta.block_size
        blocks: list[int] = []
        kv_start: list[int] = []
        masks: list[Tensor | None] = []
        for i, (table, ctx) in enumerate(zip(meta.block_tables, meta.context_lens)):
            used = -(-ctx // bs)
            assert len(table) >= used, "block table shorter than context"
            kv_start.append(len(blocks) * bs)
            blocks.extend(table[:used])  # a list or an int32 array (the block manager's): not +=
            n = meta.query_start[i + 1] - meta.query_start[i]
            if n == 1 or n == ctx:
                masks.append(None)
            else:
                # New query j sits at absolute position ctx - n + j and sees keys 0..that position.
                q_pos = torch.arange(ctx - n, ctx, device=device)
                masks.append(torch.arange(ctx, device=device)[None, :] <= q_pos[:, None])
        return _KVGather(torch.tensor(blocks, device=device), kv_start, masks)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Tensor:
    """q [T,H,D], k/v [T,Hkv,D]; k_cache/v_cache [num_blocks*block_size, Hkv, D] (flat-slot views of
    one layer's pool). Writes k, v at meta.slot_mapping, then for each sequence attends its new
    queries over all its KV (gathered through its block table up to context_len) with a causal mask:
    the query at absolute position p sees keys 0..p. GQA by head groups. kv_scales: an fp8 pool's
    (k_scale, v_scale). Returns [T, H, D]."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
    return sdpa_attention(q, k_cache, v_cache, meta, scale, kv_scales)


def to_cache(x: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """x as a pool of dtype stores it: cast; into fp8, x / scale clamped to +-448."""
    if dtype != FP8:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_cache(x: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """Pool entries x as the model reads them, in dtype: cast; from fp8, x * scale."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Write the step's new keys and values [T, Hkv, D] at their flat slots of one layer's pool."""
    for cache, x, scale in ((k_cache, k, kv_scales[0]), (v_cache, v, kv_scales[1])):
        x = to_cache(x, cache.dtype, scale)
        if cache.dtype == FP8:  # index_copy_ has no float8 kernel on the CPU: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.index_copy_(0, slot_mapping, x)


def sdpa_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Tensor:
    """reference_attention after the store: PyTorch's SDPA per sequence over its gathered blocks."""
    gather = meta.kv_gather(q.device)
    # One gather of whole blocks per layer for all sequences (a few large row copies), then
    # per-sequence views.
    num_slots, hkv, d = k_cache.shape
    bs = meta.block_size
    keys, values = (
        from_cache(
            cache.view(num_slots // bs, -1).index_select(0, gather.blocks).view(-1, hkv, d),
            q.dtype,
            s,
        )
        for cache, s in ((k_cache, kv_scales[0]), (v_cache, kv_scales[1]))
    )
    out = []
    for i, mask in enumerate(gather.masks):
        qs, qe = meta.query_start[i], meta.query_start[i + 1]
        ks, ke = gather.kv_start[i], gather.kv_start[i] + meta.context_lens[i]
        # 4-D [1, heads, len, D]: with 3-D inputs PyTorch falls back to its slow math kernel on CPU.
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1)[None],
            keys[ks:ke].transpose(0, 1)[None],
            values[ks:ke].transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None and qe - qs > 1,
            scale=scale,
            enable_gqa=True,
        )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


class TorchBackend(AttentionBackend):
    """Gathers each sequence's blocks and runs PyTorch's SDPA per sequence; runs anywhere, captures
    no graphs."""

    name = "torch"
    ops = TorchOps()

    def prepare(self, batch: StepBatch) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=self.device),
            query_start=batch.query_start,
            context_lens=batch.seq_lens,
            block_tables=batch.block_tables,
            block_size=batch.block_size,
        )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> Tensor:
        return reference_attention(q, k, v, k_cache, v_cache, meta, scale, kv_scales)
