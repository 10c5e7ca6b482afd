"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch, with Hugging Face parameter names.

One code path covers the four architectures; they differ only in q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings and the RoPE frequencies (Llama 3 scaling). Attention reads and writes a paged KV pool.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.attention import AttentionMetadata, reference_attention
from engine.config import ModelConfig


def kv_pool_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the KV pool: (num_layers, 2 for K and V, num_blocks, block_size, num_kv_heads, head_dim)."""
    return (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_block_nbytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers, K and V."""
    return math.prod(kv_pool_shape(cfg, 1, block_size)) * dtype.itemsize


def rope_inv_freq(cfg: ModelConfig, device: torch.device) -> Tensor:
    """RoPE inverse frequencies theta^(-2i/d), with Llama 3's frequency-dependent scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / s["low_freq_factor"], inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    is_medium = (wavelen >= old_len / s["high_freq_factor"]) & (wavelen <= old_len / s["low_freq_factor"])
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, D] by position, pairing dimension i with i + D/2 (Hugging Face's rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32, as the reference does, so low-precision models match it.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache bound by Model.bind_kv_cache."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_dim, bias=cfg.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(h, kv_dim, bias=cfg.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(h, kv_dim, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_dim, h, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.k_cache: Tensor | None = None  # [num_blocks * block_size, Hkv, D], a view of the shared pool
        self.v_cache: Tensor | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        assert self.k_cache is not None and self.v_cache is not None, "call Model.bind_kv_cache first"
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = reference_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """Holds the parameters under Hugging Face's `model.` prefix."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Model(nn.Module):
    """Causal LM over concatenated (unpadded) sequences; parameter names equal the checkpoint's tensor names."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype or cfg.dtype
        self.model = Decoder(cfg, self.dtype)
        # Tied checkpoints have no lm_head tensor: compute_logits reuses embed_tokens.weight.
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=self.dtype)
        self.requires_grad_(False)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.init_rope(torch.get_default_device())

    def init_rope(self, device: torch.device) -> None:
        """(Re)compute the per-process float32 cos/sin tables [max_position_embeddings, head_dim/2] on device."""
        positions = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = positions[:, None] * rope_inv_freq(self.cfg, device)[None, :]
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    def bind_kv_cache(self, kv_pool: Tensor) -> None:
        """kv_pool has shape kv_pool_shape(cfg, num_blocks, block_size); layer i uses kv_pool[i]."""
        assert kv_pool.dim() == 6 and kv_pool.shape[:2] == (self.cfg.num_layers, 2), "not a kv_pool_shape tensor"
        assert kv_pool.shape[4:] == (self.cfg.num_kv_heads, self.cfg.head_dim), "KV pool built for another model"
        attentions = [m for m in self.modules() if isinstance(m, Attention)]  # in layer order
        for i, attn in enumerate(attentions):
            attn.k_cache = kv_pool[i, 0].flatten(0, 1)
            attn.v_cache = kv_pool[i, 1].flatten(0, 1)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """input_ids, positions [T] int64 -> final-norm hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.model.layers:
            h = layer(h, cos, sin, meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
