"""store_kv: each token's K/V lands at its slot (cast to the cache dtype), negative slots write
nothing."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def check_store(
    t: int,
    kv_heads: int,
    head_dim: int,
    num_slots: int,
    src_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    slot_dtype: torch.dtype,
    seed: int,
    device: str = DEVICE,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # k and v as slices of a fused qkv projection output: row stride (heads + 2 * kv_heads) *
    # head_dim.
    width = kv_heads * head_dim
    qkv = torch.randn(t, 6 * width, generator=gen).to(device, src_dtype)
    k = qkv[:, 4 * width : 5 * width].view(t, kv_heads, head_dim)
    v = qkv[:, 5 * width :].view(t, kv_heads, head_dim)
    slots = torch.randperm(num_slots, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.25] = -1  # padded rows
    slots = slots.to(device, slot_dtype)
    sentinel = 7.0
    k_cache = torch.full(
        (num_slots, kv_heads, head_dim), sentinel, dtype=cache_dtype, device=device
    )
    v_cache = torch.full_like(k_cache, sentinel)
    store_kv(k, v, k_cache, v_cache, slots)

    written = slots >= 0
    target = slots[written].long()
    for cache, src in ((k_cache, k), (v_cache, v)):
        if cache_dtype == src_dtype:
            assert torch.equal(cache[target], src[written])
        else:  # within one bf16 ulp: the interpreter truncates where the GPU rounds to nearest
            torch.testing.assert_close(
                cache[target].float(), src[written].float(), rtol=2**-7, atol=0
            )
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[target] = False
    assert (k_cache[untouched] == sentinel).all() and (v_cache[untouched] == sentinel).all()


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv(
    src_dtype: torch.dtype, cache_dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    check_store(23, 3, 24, 64, src_dtype, cache_dtype, slot_dtype, seed=1)


def test_store_kv_one_head_small_dim() -> None:
    check_store(9, 1, 8, 16, torch.float32, torch.float32, torch.int64, seed=2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_store_kv_llama() -> None:
    check_store(
        8192, 8, 128, 65536, torch.bfloat16, torch.bfloat16, torch.int64, seed=3, device="cuda"
    )
