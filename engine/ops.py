"""The model's elementwise operations in plain PyTorch: the CPU path, and the reference the fused
kernels match.

An attention backend carries an `ops` object with these methods; the Triton
backend's (engine/kernels/) fuse each elementwise one into one kernel on the GPU,
and the CPU backend's runs the linear layers on prepacked weights (cpu_linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.quant import Fp8Weight, fp8_linear


@dataclass
class Experts:
    """A mixture-of-experts layer's weights: w13 [E, 2I, H] (each expert's gate rows, then its up
    rows) and w2 [E, H, I] stacked, and a view of each expert's, made once (the CPU backend keeps
    its packed copy of a weight per tensor, so the views must live as long as the weights)."""

    w13: Tensor
    w2: Tensor
    w13_each: list[Tensor]
    w2_each: list[Tensor]

    @classmethod
    def of(cls, w13: Tensor, w2: Tensor) -> Experts:
        return cls(w13, w2, list(w13.unbind(0)), list(w2.unbind(0)))

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The router's choice for each token from its logits [T, E]: (weights [T, top_k] float32,
    expert ids [T, top_k] int64), the top_k experts by softmax (in float32, as transformers
    computes it) and their softmax values, renormalised to sum to 1 if asked."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TorchOps:
    """RMSNorm (with the residual add), RoPE and SiLU-and-multiply, as Hugging Face's Llama computes
    them."""

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x / rms(x) * weight over the last dimension, normalised in float32 as the reference
        does."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    @classmethod
    def add_rms_norm(
        cls, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """(rms_norm(x + residual), x + residual): the pre-norm block's residual stream and the next
        sublayer's input."""
        s = x + residual
        return cls.rms_norm(s, weight, eps), s

    @staticmethod
    def apply_rope(
        q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Rotate q [T, H, D] and k [T, Hkv, D] by position; cos/sin [max_positions, D/2] float32
        tables. Dimension i pairs with i + D/2 (Hugging Face's rotate_half layout)."""
        c, s = cos[positions][:, None, :].to(q.dtype), sin[positions][:, None, :].to(q.dtype)

        def rotate(x: Tensor) -> Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

        return rotate(q), rotate(k)

    @staticmethod
    def linear(x: Tensor, weight: Tensor | Fp8Weight, bias: Tensor | None = None) -> Tensor:
        """x @ weight.T + bias, as torch.nn.functional.linear; an FP8 weight through
        quant.fp8_linear."""
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    route = staticmethod(route)

    @staticmethod
    def silu_and_mul(x: Tensor) -> Tensor:
        """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def moe(cls, x: Tensor, experts: Experts, weights: Tensor, ids: Tensor) -> Tensor:
        """The mixture of experts' output [T, H] for x [T, H] routed to ids [T, K] with weights
        [T, K] (route): the tokens grouped by expert, each expert that any token chose run once
        over its tokens through this class's linear (only the chosen experts' weights are read),
        its outputs weighted and summed per token in float32, expert by expert in order (as
        transformers sums them)."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        tokens, chosen = order // k, weights.flatten()[order]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=experts.num_experts).tolist()):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            h = cls.silu_and_mul(cls.linear(x[rows], experts.w13_each[e]))
            h = cls.linear(h, experts.w2_each[e]).float() * chosen[start : start + n, None]
            out.index_add_(0, rows, h)
            start += n
        return out.to(x.dtype)
