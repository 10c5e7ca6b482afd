"""The model's elementwise operations in plain PyTorch: the CPU path, and the reference the fused
kernels match.

An attention backend carries an `ops` object with these methods; the Triton
backend's (engine/kernels/) fuse each elementwise one into one kernel on the GPU,
and the CPU backend's runs the linear layers on prepacked weights (cpu_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ weight.T + bias, as torch.nn.functional.linear."""
        return F.linear(x, weight, bias)

    @staticmethod
    def silu_and_mul(x: Tensor) -> Tensor:
        """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
