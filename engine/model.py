"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Qwen3-MoE,
Mixtral and OLMoE) in plain PyTorch, with Hugging Face parameter names.

One code path covers the architectures; they differ only in q/k/v bias (Qwen2), q/k RMSNorm (per
head: Qwen3, Qwen3-MoE; over the whole projection: OLMoE), tied embeddings, the RoPE frequencies
(Llama 3 scaling) and the feed-forward: a SwiGLU MLP, or a mixture of SwiGLU experts (MoE) whose
experts are stacked into two tensors per layer (the loader gathers the checkpoint's per-expert
ones; those are the only parameters not named as in the checkpoint). Attention reads and writes a
paged KV pool.

Under tensor parallelism (a config from ModelConfig.sharded, and Model.tp) each rank holds
Megatron's shard: its heads of q/k/v and the matching columns of o_proj, its part of gate/up and the
matching columns of down_proj (of each expert's too), its part of the vocabulary's rows of the
embedding and lm_head; o_proj's, down_proj's and the experts' partial sums and the embedding are
all-reduced, the logits all-gathered, so every rank ends a step with the same hidden states and
logits.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from engine.attention.base import AttentionBackend, Ops
from engine.config import ModelConfig
from engine.ops import Experts
from engine.parallel import SINGLE, TensorParallel
from engine.quant import Fp8Linear, dequantize, make_linear, weight_of


def kv_pool_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the KV pool: (num_layers, 2 for K and V, num_blocks, block_size, num_kv_heads,
    head_dim)."""
    return (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_block_nbytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers, K and V."""
    return math.prod(kv_pool_shape(cfg, 1, block_size)) * dtype.itemsize


def rope_inv_freq(cfg: ModelConfig, device: torch.device) -> Tensor:
    """RoPE inverse frequencies theta^(-2i/d), with Llama 3's frequency-dependent scaling when
    configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    )
    return inv_freq if cfg.rope_scaling is None else llama3_scaled(inv_freq, cfg.rope_scaling)


def llama3_scaled(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1's scaling of RoPE inverse frequencies: keep high frequencies, divide low ones by
    `factor`, interpolate smoothly in between."""
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / s["low_freq_factor"], inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    is_medium = (wavelen >= old_len / s["high_freq_factor"]) & (
        wavelen <= old_len / s["low_freq_factor"]
    )
    return torch.where(is_medium, smoothed, scaled)


class StepContext:
    """What every layer of one forward pass shares: the attention backend, its metadata for this
    step, positions, and the rank's communicator."""

    __slots__ = ("backend", "meta", "positions", "cos", "sin", "tp")

    def __init__(
        self,
        backend: AttentionBackend,
        meta: Any,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.backend, self.meta, self.positions, self.cos, self.sin, self.tp = (
            backend,
            meta,
            positions,
            cos,
            sin,
            tp,
        )


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension; given a residual, adds it first and returns the
    sum too."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor, ops: Ops, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache bound by Model.bind_kv_cache. Its
    projections are FP8 where the config's quantization says (engine/quant.py); an FP8 KV pool is
    read and written through kv_scales (Model.bind_kv_cache)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, prefix: str = "") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h, q_dim, kv_dim = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        )
        q = cfg.quantization
        bias = cfg.attention_bias
        self.q_proj = make_linear(prefix + "q_proj", h, q_dim, bias, dtype, q)
        self.k_proj = make_linear(prefix + "k_proj", h, kv_dim, bias, dtype, q)
        self.v_proj = make_linear(prefix + "v_proj", h, kv_dim, bias, dtype, q)
        self.o_proj = make_linear(prefix + "o_proj", q_dim, h, False, dtype, q)
        # per head (Qwen3) or over the whole projection (OLMoE)
        self.qk_norm = cfg.qk_norm
        q_norm_dim, k_norm_dim = (q_dim, kv_dim) if cfg.qk_norm == "full" else (cfg.head_dim,) * 2
        self.q_norm = RMSNorm(q_norm_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.split = [q_dim, kv_dim, kv_dim]
        # One GEMM for q, k and v: views over the three checkpoint tensors, which the arena lays out
        # adjacent.
        self.qkv_weight: Tensor | None = None
        self.qkv_bias: Tensor | None = None
        self.qkv_weight_scale: Tensor | None = None  # FP8: the three layers' scales, one view
        # An FP8 pool's per-tensor scales (keys, values): what a stored element is multiplied by.
        self.kv_scales = (1.0, 1.0)
        self.k_cache: Tensor | None = (
            None  # [num_blocks * block_size, Hkv, D], a view of the shared pool
        )
        self.v_cache: Tensor | None = None

    def fused_groups(self) -> dict[str, list[str]]:
        """Attributes that bind_arena sets to one view over several adjacent parameters (names
        relative to self)."""
        if len({type(p) for p in (self.q_proj, self.k_proj, self.v_proj)}) > 1:
            return {}  # an FP8 checkpoint that keeps some of them in 16 bits: three GEMMs
        groups = {"qkv_weight": ["q_proj.weight", "k_proj.weight", "v_proj.weight"]}
        if isinstance(self.q_proj, Fp8Linear):
            groups["qkv_weight_scale"] = [f"{n}_proj.weight_scale" for n in "qkv"]
        if self.q_proj.bias is not None:
            groups["qkv_bias"] = ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        return groups

    def forward(self, x: Tensor, step: StepContext) -> Tensor:
        assert self.k_cache is not None and self.v_cache is not None, (
            "call Model.bind_kv_cache first"
        )
        ops = step.backend.ops
        t = x.shape[0]
        if (qkv := self.fused_qkv()) is not None:
            q, k, v = ops.linear(x, qkv, self.qkv_bias).split(self.split, dim=-1)
        else:
            q, k, v = (
                ops.linear(x, weight_of(p), p.bias) for p in (self.q_proj, self.k_proj, self.v_proj)
            )
        if self.qk_norm == "full" and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops)[0], self.k_norm(k, ops)[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head" and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops)[0], self.k_norm(k, ops)[0]  # over the last dimension
        o = step.backend.rope_and_attend(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            step.meta,
            self.scale,
            step.positions,
            step.cos,
            step.sin,
            kv_scales=self.kv_scales,
        )
        return step.tp.all_reduce(
            ops.linear(o.reshape(t, self.num_heads * self.head_dim), weight_of(self.o_proj))
        )

    def fused_qkv(self) -> Tensor | Any | None:
        """The one weight of q, k and v (an Fp8Weight when quantized), or None where the arena
        could not lay them out adjacent."""
        if self.qkv_weight is None:
            return None
        if isinstance(self.q_proj, Fp8Linear):
            if self.qkv_weight_scale is None:
                return None
            return self.q_proj.fp8(self.qkv_weight, self.qkv_weight_scale)
        return self.qkv_weight


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), its projections FP8 where the config's
    quantization says."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, prefix: str = "") -> None:
        super().__init__()
        h, width, q = cfg.hidden_size, cfg.intermediate_size, cfg.quantization
        self.gate_proj = make_linear(prefix + "gate_proj", h, width, False, dtype, q)
        self.up_proj = make_linear(prefix + "up_proj", h, width, False, dtype, q)
        self.down_proj = make_linear(prefix + "down_proj", width, h, False, dtype, q)
        self.gate_up_weight: Tensor | None = (
            None  # one GEMM for gate and up, as for Attention.qkv_weight
        )
        self.gate_up_weight_scale: Tensor | None = None

    def fused_groups(self) -> dict[str, list[str]]:
        if type(self.gate_proj) is not type(self.up_proj):
            return {}  # one of them kept in 16 bits by an FP8 checkpoint: two GEMMs
        groups = {"gate_up_weight": ["gate_proj.weight", "up_proj.weight"]}
        if isinstance(self.gate_proj, Fp8Linear):
            groups["gate_up_weight_scale"] = ["gate_proj.weight_scale", "up_proj.weight_scale"]
        return groups

    def forward(self, x: Tensor, ops: Ops, tp: TensorParallel = SINGLE) -> Tensor:
        fused: Any = self.gate_up_weight
        if fused is not None and isinstance(self.gate_proj, Fp8Linear):
            scale = self.gate_up_weight_scale
            fused = None if scale is None else self.gate_proj.fp8(fused, scale)
        if fused is not None:
            gate_up = ops.linear(x, fused)
        else:
            gate_up = torch.cat(
                (ops.linear(x, weight_of(self.gate_proj)), ops.linear(x, weight_of(self.up_proj))),
                dim=-1,
            )
        return tp.all_reduce(ops.linear(ops.silu_and_mul(gate_up), weight_of(self.down_proj)))


class MoE(nn.Module):
    """Mixture of SwiGLU experts: the router (`gate`) scores the experts, each token goes to its
    num_experts_per_tok best by softmax, and their outputs are summed weighted by those softmax
    values (renormalised over the chosen where the model says). The experts' gate and up
    projections are stacked in w13 [E, 2I, H] (gate rows first), their down projections in w2
    [E, H, I]; a rank of a tensor-parallel unit holds its part of I of every expert."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, width = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(h, e, bias=False, dtype=dtype)
        self.w13 = nn.Parameter(torch.empty(e, 2 * width, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, width, dtype=dtype), requires_grad=False)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self._experts: Experts | None = None

    def experts(self) -> Experts:
        """The stacked weights and their per-expert views, made again once the loader has bound new
        parameters."""
        if self._experts is None or self._experts.w13 is not self.w13:
            self._experts = Experts.of(self.w13, self.w2)
        return self._experts

    def forward(self, x: Tensor, ops: Ops, tp: TensorParallel = SINGLE) -> Tensor:
        weights, ids = ops.route(ops.linear(x, self.gate.weight), self.top_k, self.renormalize)
        return tp.all_reduce(ops.moe(x, self.experts(), weights, ids))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block. The residual stream travels beside the hidden state, so that each
    residual add fuses with the RMSNorm that follows it: (h, residual) -> (next sublayer input, new
    residual)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        p = f"model.layers.{index}."
        self.self_attn = Attention(cfg, dtype, p + "self_attn.")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MoE(cfg, dtype) if index in cfg.moe_layers else MLP(cfg, dtype, p + "mlp.")

    def forward(
        self, h: Tensor, residual: Tensor | None, step: StepContext
    ) -> tuple[Tensor, Tensor]:
        ops = step.backend.ops
        x, residual = self.input_layernorm(h, ops, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, step), ops, residual)
        return self.mlp(x, ops, step.tp), residual


def kv_bounds(layer: DecoderLayer) -> tuple[float, float]:
    """Bounds on the absolute value of any key (after RoPE) and value the layer can store, from its
    weights alone: its input is RMS-normalised (each element at most sqrt(hidden) times the norm's
    weight), so a projected element is at most the norm of its weight row times the norm's weights
    times sqrt(hidden), plus its bias; a per-head (Qwen3) or whole (OLMoE) k norm bounds keys by
    its weight times the square root of its width; RoPE rotates pairs of elements (i, i + D/2), so
    a key's element is at most the pair's bound's length."""
    attn = layer.self_attn
    gamma = layer.input_layernorm.weight.float()
    root = gamma.numel() ** 0.5

    def projected(linear: nn.Module) -> Tensor:
        w = weight_of(linear)
        dense = w.float() if isinstance(w, Tensor) else dequantize(w.data, w.scale, w.group)
        bound = (dense * gamma).norm(dim=1) * root
        return bound if linear.bias is None else bound + linear.bias.float().abs()

    keys, values = projected(attn.k_proj), projected(attn.v_proj)
    if attn.qk_norm == "head" and attn.k_norm is not None:
        keys = (attn.k_norm.weight.float().abs() * attn.head_dim**0.5).repeat(attn.num_kv_heads)
    elif attn.qk_norm == "full" and attn.k_norm is not None:
        keys = attn.k_norm.weight.float().abs() * attn.k_norm.weight.numel() ** 0.5
    pairs = keys.view(attn.num_kv_heads, 2, attn.head_dim // 2)
    return float(pairs.norm(dim=1).max()), float(values.max())


class Decoder(nn.Module):
    """Holds the parameters under Hugging Face's `model.` prefix."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        # This rank's rows. Given its (meta) weight, nn.Embedding skips its random init, whose
        # normal_ would import torch._dynamo: seconds of every worker's start for nothing.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_rows,
            cfg.hidden_size,
            _weight=torch.empty(cfg.vocab_rows, cfg.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Model(nn.Module):
    """Causal LM over concatenated (unpadded) sequences; parameter names equal the checkpoint's
    tensor names."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype or cfg.dtype
        self.model = Decoder(cfg, self.dtype)
        # Tied checkpoints have no lm_head tensor: compute_logits reuses embed_tokens.weight.
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_rows, bias=False, dtype=self.dtype)
        self.requires_grad_(False)
        # the rank's communicator when cfg is a tensor-parallel shard (set before the first step)
        self.tp = SINGLE
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        if (device := torch.get_default_device()).type == "meta":
            # build_model: bind_arena computes them on the arena's device (arange on the meta
            # device would import torch._dynamo, seconds of every worker's start).
            self.register_buffer("rope_cos", None, persistent=False)
            self.register_buffer("rope_sin", None, persistent=False)
        else:
            self.init_rope(device)

    def init_rope(self, device: torch.device) -> None:
        """(Re)compute the per-process float32 cos/sin tables [max_position_embeddings, head_dim/2]
        on device."""
        positions = torch.arange(
            self.cfg.max_position_embeddings, dtype=torch.float32, device=device
        )
        freqs = positions[:, None] * rope_inv_freq(self.cfg, device)[None, :]
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    def bind_kv_cache(self, kv_pool: Tensor) -> None:
        """kv_pool has shape kv_pool_shape(cfg, num_blocks, block_size); layer i uses kv_pool[i]."""
        assert kv_pool.dim() == 6 and kv_pool.shape[:2] == (self.cfg.num_layers, 2), (
            "not a kv_pool_shape tensor"
        )
        assert kv_pool.shape[4:] == (self.cfg.num_kv_heads, self.cfg.head_dim), (
            "KV pool built for another model"
        )
        attentions = [m for m in self.modules() if isinstance(m, Attention)]  # in layer order
        for i, attn in enumerate(attentions):
            attn.k_cache = kv_pool[i, 0].flatten(0, 1)
            attn.v_cache = kv_pool[i, 1].flatten(0, 1)

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """Each layer's (key, value) scales of an FP8 pool, in layer order: what a stored element is
        multiplied by."""
        attentions = [m for m in self.modules() if isinstance(m, Attention)]
        assert len(scales) == len(attentions), "one pair of scales per layer"
        for attn, pair in zip(attentions, scales):
            attn.kv_scales = pair

    def unbind_kv_cache(self) -> None:
        """Drop the references to the bound pool, so that its memory can be freed."""
        for attn in (m for m in self.modules() if isinstance(m, Attention)):
            attn.k_cache = attn.v_cache = None

    def forward(
        self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend, meta: Any
    ) -> Tensor:
        """input_ids, positions [T] int64; meta from backend.prepare for this step -> final-norm
        hidden states [T, hidden]."""
        assert self.tp.size == self.cfg.tp_size, "a sharded model needs its communicator (Model.tp)"
        step = StepContext(backend, meta, positions, self.rope_cos, self.rope_sin, self.tp)
        h, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, step)
        return self.model.norm(h, backend.ops, residual)[0]

    def embed(self, input_ids: Tensor) -> Tensor:
        """The input embeddings; a rank holding part of the vocabulary looks up its own ids, zeros
        the others' and sums over the ranks."""
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        start = self.tp.rank * self.cfg.vocab_rows
        local = input_ids - start
        outside = (local < 0) | (local >= self.cfg.vocab_rows)
        h = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(h.masked_fill(outside[:, None], 0))

    def compute_logits(self, hidden: Tensor, ops: Ops, out: Tensor | None = None) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab], through the backend's linear (ops); into
        out if given. Under tensor parallelism each rank computes its part of the vocabulary and
        every rank gets all of it."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = ops.linear(hidden, weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last(logits)[:, : self.cfg.vocab_size]
        return logits.float() if out is None else out.copy_(logits)
