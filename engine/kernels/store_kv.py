"""Write the step's new keys and values into the paged KV cache, K and V in one launch.

Contract: for each token t with slot_mapping[t] >= 0, k_cache[slot] = k[t] and v_cache[slot] = v[t]
(cast to the cache dtype); a negative slot (a padded row of a CUDA graph) writes nothing. k, v may
be strided views (a slice of a fused qkv projection output) as long as their last dim is contiguous.
An fp8 (e4m3) cache stores k / k_scale and v / v_scale clamped to +-448, as the torch reference does
(engine/attention/torch_backend.py: the quotient is the float32 product with the scale's
reciprocal); whether the cache is fp8 is its pointer's element type, known when the kernel compiles.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.launch import next_power_of_2

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value


@triton.jit
def to_cache(x, model_ty: tl.constexpr, cache_ptr, inv_scale):
    """x (float32, or the model's dtype model_ty) as the pool at cache_ptr stores the model's value:
    cast; into fp8, rounded to model_ty (as the model hands it over), times inv_scale (the
    reciprocal of the pool's scale) in float32, clamped to +-448 (a cast makes NaN past it)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(model_ty).to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    stride_head,
    k_inv_scale,
    v_inv_scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = slot * stride_slot + heads[:, None] * stride_head + dims[None, :]
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k = to_cache(k, k_ptr.dtype.element_ty, k_cache_ptr, k_inv_scale)
    v = to_cache(v, v_ptr.dtype.element_ty, v_cache_ptr, v_inv_scale)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    *,
    num_warps: int | None = None,
) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [num_slots, Hkv, D] at slot_mapping [T] (int64 or int32;
    < 0 skips); kv_scales: an fp8 cache's (k_scale, v_scale)."""
    t, hkv, d = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (t,)
    assert (
        k_cache.shape[1:] == (hkv, d)
        and v_cache.shape == k_cache.shape
        and k_cache.stride() == v_cache.stride()
    )
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1, (
        "last dims must be contiguous"
    )
    if t == 0:
        return
    h_pad, d_pad = next_power_of_2(hkv), next_power_of_2(d)
    warps = num_warps or min(max(h_pad * d_pad // 256, 1), 8)
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        NUM_HEADS=hkv,
        HEAD_DIM=d,
        H_PAD=h_pad,
        D_PAD=d_pad,
        num_warps=warps,
    )
