"""What an attention backend is: the step's metadata prepared once, then attention run layer by
layer.

The model runner describes each forward pass as a StepBatch (host-side lists);
the backend turns it into whatever its kernels need (prepare, once per step), and
every layer calls rope_and_attend with that metadata. A backend that supports
CUDA graphs also keeps static metadata buffers that a captured graph reads,
refilled in place before each replay: one graph per GraphBucket, a fixed shape
that a step is padded to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor

from engine.ops import Experts


def pad_tables(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Block tables (lists, or the block manager's int32 arrays) as one [len(tables), longest] int32
    array, padded with block 0: the tables joined in one copy, then laid into the rows through a
    mask (row-major, as joined)."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    out = np.zeros((len(tables), int(lens.max(initial=0))), np.int32)
    if out.size:
        out[np.arange(out.shape[1]) < lens[:, None]] = np.concatenate(tables)
    return out


@dataclass
class StepBatch:
    """One forward pass over B sequences whose new tokens are concatenated (T tokens in all)."""

    token_ids: list[int]  # [T]
    positions: list[int]  # [T] absolute position of each new token
    slot_mapping: list[int]  # [T] flat KV slot (block_id * block_size + offset) of each new token
    query_start: list[int]  # [B+1] offsets of each sequence's new tokens in T
    seq_lens: list[int]  # [B] each sequence's KV length after this step (cached + new)
    block_tables: Sequence[Sequence[int]]  # [B] block ids of each sequence, covering seq_lens
    sample_rows: list[int]  # rows of T whose logits are returned (a sequence's last new token)
    block_size: int
    hidden_rows: list[int] = field(
        default_factory=list
    )  # rows of T whose final hidden states are kept (prompt logprobs)
    num_decodes: int = (
        0  # the leading sequences that add one token each (ModelRunner.make_batch puts them first)
    )
    tables: np.ndarray | None = (
        None  # [B, longest table] int32: block_tables padded with block 0, built once a step
    )
    # (row of T, index among the previous step's sampled tokens) of each token that is the previous
    # step's sample
    previous: list[tuple[int, int]] = field(default_factory=list)

    def padded_tables(self) -> np.ndarray:
        """block_tables as one [B, longest table] int32 array, padded with block 0 (what every
        kernel reads: a sequence's row only up to its context), made on the first call."""
        if self.tables is None:
            self.tables = pad_tables(self.block_tables)
        return self.tables

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.query_start, self.query_start[1:]))

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token and samples it: the shape CUDA graphs capture."""
        return (
            len(self.token_ids) == self.num_seqs == len(self.sample_rows) and not self.hidden_rows
        )


@dataclass(frozen=True)
class GraphBucket:
    """The fixed shape of a captured step: `tokens` new tokens of `seqs` sequences (padding rows
    included), each sequence's last token sampled. A decode bucket has one token per sequence and
    runs attention's decode grid (split-KV); any other bucket holds steps of up to `tokens` tokens
    over up to `seqs` sequences (prefills, append-prefills, decodes beside them), padded with
    sequences of no tokens and tokens of no sequence."""

    tokens: int
    seqs: int
    decode: bool

    @property
    def max_query_len(self) -> int:
        """What the captured attention is planned for: 1 (decode grid), else a query of the whole
        bucket."""
        return 1 if self.decode else self.tokens


class Ops(Protocol):
    """The elementwise operations a backend provides (engine/ops.py is the reference). add_rms_norm
    may write its results into x and residual (the model never reads either again)."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...
    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]: ...
    def apply_rope(
        self, q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]: ...
    def silu_and_mul(self, x: Tensor) -> Tensor: ...
    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...
    def route(self, logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]: ...
    def moe(self, x: Tensor, experts: Experts, weights: Tensor, ids: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class AttentionShape:
    """What a backend needs to know of the model and the KV pool."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_blocks_per_seq: int  # the longest block table (max_model_len / block_size, rounded up)


class AttentionBackend(ABC):
    """Paged attention for one device. forward() writes the new tokens' K/V into the pool, then
    attends."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    ops: Ops

    def __init__(self, shape: AttentionShape, device: torch.device) -> None:
        self.shape = shape
        self.device = device

    @abstractmethod
    def prepare(self, batch: StepBatch) -> Any:
        """The metadata every layer of this step shares, built once."""

    @abstractmethod
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: Any,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> Tensor:
        """q [T, H, D], k/v [T, Hkv, D]; k_cache/v_cache [num_slots, Hkv, D], one layer's view of
        the pool. Stores k, v at the step's slots, then each new query at position p attends keys
        0..p of its sequence. Returns [T, H, D].

        The pool may be float8_e4m3fn under a model of another dtype: it stores a key as
        clamp(k / k_scale, -448, 448) and reads it as stored * k_scale, values likewise with
        v_scale (kv_scales, the layer's); a pool of the model's dtype has scales (1.0, 1.0)
        (torch_backend.py is the reference)."""

    def rope_and_attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: Any,
        scale: float,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> Tensor:
        """forward() after rotating q and k by position (ops.apply_rope's contract): what a layer
        calls. A backend with a fused RoPE-and-store kernel overrides it."""
        q, k = self.ops.apply_rope(q, k, positions, cos, sin)
        return self.forward(q, k, v, k_cache, v_cache, meta, scale, kv_scales=kv_scales)

    # ---- CUDA graphs (backends with supports_cuda_graphs) ----------------------------------------

    def graph_metadata(self, buckets: list[GraphBucket], num_sms: int | None = None) -> Any:
        """Static metadata buffers for every bucket of buckets, allocated once; num_sms: the SMs the
        graphs will run on (a green-context share; None: the whole device), which sizes decode's KV
        splits."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def graph_metadata_bytes(self, buckets: list[GraphBucket], num_sms: int | None = None) -> int:
        """What graph_metadata(buckets, num_sms) allocates, in bytes, allocating nothing (the memory
        plan's)."""
        return 0

    def graph_view(self, static: Any, bucket: GraphBucket) -> Any:
        """The metadata a graph of bucket's shape is captured with: views of the static buffers."""
        raise NotImplementedError

    def fill_graph_metadata(self, static: Any, batch: StepBatch, bucket: GraphBucket) -> None:
        """Copy batch's metadata into the static buffers in place, padded to bucket: padding
        sequences have no tokens and no context, padding tokens belong to no sequence and write
        no KV."""
        raise NotImplementedError
