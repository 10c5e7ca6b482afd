"""Write the step's new keys and values into the paged KV cache, K and V in one launch.

Contract: for each token t with slot_mapping[t] >= 0, k_cache[slot] = k[t] and v_cache[slot] = v[t]
(cast to the cache dtype); a negative slot (a padded row of a CUDA graph) writes nothing. k, v may
be strided views (a slice of a fused qkv projection output) as long as their last dim is contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.launch import next_power_of_2


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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    num_warps: int | None = None,
) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [num_slots, Hkv, D] at slot_mapping [T] (int64 or int32;
    < 0 skips)."""
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
        NUM_HEADS=hkv,
        HEAD_DIM=d,
        H_PAD=h_pad,
        D_PAD=d_pad,
        num_warps=warps,
    )
