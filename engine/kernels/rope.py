"""Rotary position embedding of q and k in one launch (Hugging Face's rotate_half layout).

Contract: dimension i pairs with i + D/2; with c, s = cos[pos], sin[pos] (float32 tables [max_positions, D/2]),
out[:D/2] = x1 * c - x2 * s and out[D/2:] = x2 * c + x1 * s, computed in float32 and rounded once to x's dtype.
Inputs may be strided views (e.g. of a fused qkv projection); outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate(x_ptr, out_ptr, stride_h, cos, sin, offs_i, i_ok,
            NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, H_PAD)
    mask = (heads < NUM_HEADS)[:, None] & i_ok[None, :]
    src = x_ptr + heads[:, None] * stride_h + offs_i[None, :]
    dst = out_ptr + heads[:, None] * (2 * HALF) + offs_i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    H: tl.constexpr, HKV: tl.constexpr, H_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    _rotate(q_ptr + t * stride_qt, q_out_ptr + t * (H * 2 * HALF), stride_qh, cos, sin, offs_i, i_ok, H, H_PAD, HALF)
    _rotate(k_ptr + t * stride_kt, k_out_ptr + t * (HKV * 2 * HALF), stride_kh, cos, sin, offs_i, i_ok,
            HKV, HKV_PAD, HALF)


def apply_rope(q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, *,
               num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by positions [T]; cos/sin [max_positions, D/2]. Returns new (q, k)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    assert d % 2 == 0 and k.shape == (t, hkv, d) and positions.shape == (t,)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.shape[1] == d // 2 and sin.shape[1] == d // 2
    q_out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, hkv, d, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half_pad = triton.next_power_of_2(d // 2)
    h_pad = triton.next_power_of_2(h)
    warps = num_warps or min(max(h_pad * half_pad // 256, 1), 8)
    _rope_kernel[(t,)](
        q, k, q_out, k_out, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        H=h, HKV=hkv, H_PAD=h_pad, HKV_PAD=triton.next_power_of_2(hkv), HALF=d // 2, HALF_PAD=half_pad,
        num_warps=warps,
    )
    return q_out, k_out
