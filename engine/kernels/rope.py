"""Rotary position embedding of q and k in one launch (Hugging Face's rotate_half layout), alone or
fused with the store of the step's keys and values into the paged KV cache.

Contract: dimension i pairs with i + D/2; with c, s = cos[pos], sin[pos] (float32 tables
[max_positions, D/2]), out[:D/2] = x1 * c - x2 * s and out[D/2:] = x2 * c + x1 * s, computed in
float32 and rounded once to the output's dtype. Inputs may be strided views (e.g. of a fused qkv
projection); q's output is a contiguous tensor.

rope_store_kv is apply_rope followed by store_kv (store_kv.py) in one launch: the rotated keys go
straight to their cache slots, and the values beside them; a token whose slot is negative (a padding
row of a CUDA graph) writes no KV. It saves a launch, the rotated keys' round trip through memory
and an allocation per layer. Into an fp8 cache it stores what store_kv would store of apply_rope's
keys: each rotated key rounded to the model's dtype, then quantized with the layer's scale.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.launch import Consts, Launches, launch, next_power_of_2
from engine.kernels.store_kv import to_cache


@triton.jit
def _rotate(
    x_ptr,
    out_ptr,
    stride_h,
    stride_out_h,
    cos,
    sin,
    offs_i,
    i_ok,
    inv_scale,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate x's heads into out: the model's dtype, or a KV cache's (inv_scale: an fp8 cache's
    reciprocal scale, store_kv.to_cache)."""
    heads = tl.arange(0, H_PAD)
    mask = (heads < NUM_HEADS)[:, None] & i_ok[None, :]
    src = x_ptr + heads[:, None] * stride_h + offs_i[None, :]
    dst = out_ptr + heads[:, None] * stride_out_h + offs_i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    model_ty = x_ptr.dtype.element_ty
    lo = x1 * cos[None, :] - x2 * sin[None, :]
    hi = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst, to_cache(lo, model_ty, out_ptr, inv_scale), mask=mask)
    tl.store(dst + HALF, to_cache(hi, model_ty, out_ptr, inv_scale), mask=mask)


@triton.jit
def _cos_sin(
    pos_ptr, cos_ptr, sin_ptr, t, stride_cos, stride_sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr
):
    """Token t's rotation: cos and sin of its position over the first HALF dimensions (float32),
    with their offsets and mask."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    return cos, sin, offs_i, i_ok


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    H: tl.constexpr,
    HKV: tl.constexpr,
    H_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos, sin, offs_i, i_ok = _cos_sin(
        pos_ptr, cos_ptr, sin_ptr, t, stride_cos, stride_sin, HALF, HALF_PAD
    )
    _rotate(
        q_ptr + t * stride_qt,
        q_out_ptr + t * (H * 2 * HALF),
        stride_qh,
        2 * HALF,
        cos,
        sin,
        offs_i,
        i_ok,
        1.0,
        H,
        H_PAD,
        HALF,
    )
    _rotate(
        k_ptr + t * stride_kt,
        k_out_ptr + t * (HKV * 2 * HALF),
        stride_kh,
        2 * HALF,
        cos,
        sin,
        offs_i,
        i_ok,
        1.0,
        HKV,
        HKV_PAD,
        HALF,
    )


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    stride_head,
    stride_cos,
    stride_sin,
    k_inv_scale,
    v_inv_scale,
    H: tl.constexpr,
    HKV: tl.constexpr,
    H_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos, sin, offs_i, i_ok = _cos_sin(
        pos_ptr, cos_ptr, sin_ptr, t, stride_cos, stride_sin, HALF, HALF_PAD
    )
    _rotate(
        q_ptr + t * stride_qt,
        q_out_ptr + t * (H * 2 * HALF),
        stride_qh,
        2 * HALF,
        cos,
        sin,
        offs_i,
        i_ok,
        1.0,
        H,
        H_PAD,
        HALF,
    )
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _rotate(
            k_ptr + t * stride_kt,
            k_cache_ptr + slot * stride_slot,
            stride_kh,
            stride_head,
            cos,
            sin,
            offs_i,
            i_ok,
            k_inv_scale,
            HKV,
            HKV_PAD,
            HALF,
        )
        heads = tl.arange(0, HKV_PAD)
        dims = tl.arange(0, D_PAD)
        mask = (heads < HKV)[:, None] & (dims < 2 * HALF)[None, :]
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(
            v_cache_ptr + slot * stride_slot + heads[:, None] * stride_head + dims[None, :],
            to_cache(v, v_ptr.dtype.element_ty, v_cache_ptr, v_inv_scale),
            mask=mask,
        )


@lru_cache(maxsize=None)
def _pads(h: int, hkv: int, d: int) -> tuple[int, int, int, int, int]:
    """(H_PAD, HKV_PAD, HALF_PAD, D_PAD, default warps) of a model's head shape."""
    half_pad, h_pad = next_power_of_2(d // 2), next_power_of_2(h)
    return (
        h_pad,
        next_power_of_2(hkv),
        half_pad,
        next_power_of_2(d),
        min(max(h_pad * half_pad // 256, 1), 8),
    )


@lru_cache(maxsize=None)
def _fused_consts(h: int, hkv: int, d: int, num_warps: int | None) -> Consts:
    h_pad, hkv_pad, half_pad, d_pad, warps = _pads(h, hkv, d)
    return Consts(
        H=h,
        HKV=hkv,
        H_PAD=h_pad,
        HKV_PAD=hkv_pad,
        HALF=d // 2,
        HALF_PAD=half_pad,
        D_PAD=d_pad,
        num_warps=num_warps or warps,
    )


def apply_rope(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by positions [T]; cos/sin [max_positions, D/2]. Returns
    new (q, k)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    assert d % 2 == 0 and k.shape == (t, hkv, d) and positions.shape == (t,)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.shape[1] == d // 2 and sin.shape[1] == d // 2
    q_out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, hkv, d, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    h_pad, hkv_pad, half_pad, _, warps = _pads(h, hkv, d)
    _rope_kernel[(t,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        H=h,
        HKV=hkv,
        H_PAD=h_pad,
        HKV_PAD=hkv_pad,
        HALF=d // 2,
        HALF_PAD=half_pad,
        num_warps=num_warps or warps,
    )
    return q_out, k_out


def rope_store_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    out: Tensor | None = None,
    num_warps: int | None = None,
    launches: Launches | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] by positions [T] (cos/sin [max_positions, D/2]); store
    the rotated k and v [T, Hkv, D] into k_cache, v_cache [num_slots, Hkv, D] at slot_mapping [T]
    (< 0 skips; kv_scales: an fp8 cache's (k_scale, v_scale)); return the rotated q (into out, a
    contiguous [T, H, D] tensor, when given).

    The checks of apply_rope and store_kv hold for the arguments; they run here only when out is
    None, so that the engine's per-layer call (which passes out, with arguments checked once for the
    model) stays cheap. launches: the step's (engine/kernels/launch.py)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    if out is None:
        assert (
            d % 2 == 0 and k.shape == (t, hkv, d) and v.shape == k.shape and positions.shape == (t,)
        )
        assert (
            slot_mapping.shape == (t,)
            and k_cache.shape[1:] == (hkv, d)
            and v_cache.shape == k_cache.shape
        )
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
        assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, (
            "last dims must be contiguous"
        )
        assert (
            cos.stride(1) == 1
            and sin.stride(1) == 1
            and cos.shape[1] == d // 2
            and sin.shape[1] == d // 2
        )
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    qs, ks, vs, cs = q.stride(), k.stride(), v.stride(), k_cache.stride()
    tensors = (q, k, v, out, k_cache, v_cache, positions, slot_mapping, cos, sin)
    strides = (qs[0], qs[1], ks[0], ks[1], vs[0], vs[1], cs[0], cs[1], cos.stride(0), sin.stride(0))
    scalars = (*strides, 1.0 / kv_scales[0], 1.0 / kv_scales[1])
    consts = _fused_consts(h, hkv, d, num_warps)
    launch(launches, _rope_store_kv_kernel, (t,), tensors, scalars, consts)
    return out
