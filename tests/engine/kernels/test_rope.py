"""apply_rope against a float64 rotate_half reference, q and k strided views of a fused qkv output;
rope_store_kv against apply_rope followed by store_kv."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from engine.kernels.rope import apply_rope, rope_store_kv
from engine.kernels.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def reference(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos[positions].double()[:, None, :], sin[positions].double()[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_inputs(
    t: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str = DEVICE,
    max_pos: int = 4096,
) -> tuple[Tensor, ...]:
    """q, k, v as strided views of one fused qkv output; positions; float32 cos and sin tables."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos().float().to(device), freqs.sin().float().to(device)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(device)
    return q, k, v, positions, cos, sin


def check(
    t: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str = DEVICE,
) -> None:
    q, k, _, positions, cos, sin = rope_inputs(t, heads, kv_heads, head_dim, dtype, seed, device)
    q_out, k_out = apply_rope(q, k, positions, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    for out, x in ((q_out, q), (k_out, k)):
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
        ref = reference(x, positions, cos, sin)
        err = (out.double() - ref).abs()
        assert (err <= tol * (1 + ref.abs())).all(), f"max error {err.max().item():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "heads", "kv_heads", "head_dim"), [(1, 4, 2, 16), (9, 6, 2, 24), (5, 3, 1, 64)]
)
def test_apply_rope(t: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check(t, heads, kv_heads, head_dim, dtype, seed=t * head_dim)


def check_fused(
    t: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str = DEVICE,
) -> None:
    """rope_store_kv writes what apply_rope then store_kv write, bit for bit, and the same rotated
    q; a token at a negative slot (a graph's padding) writes no KV."""
    q, k, v, positions, cos, sin = rope_inputs(t, heads, kv_heads, head_dim, dtype, seed, device)
    slots = torch.randperm(3 * t, generator=torch.Generator().manual_seed(seed))[:t].to(device)
    slots[t // 2] = -1
    want = [
        torch.full((3 * t, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
        for _ in range(2)
    ]
    want_q, want_k = apply_rope(q, k, positions, cos, sin)
    store_kv(want_k, v, *want, slots)
    got = [torch.full_like(want[0], float("nan")) for _ in range(2)]
    got_q = rope_store_kv(q, k, v, positions, cos, sin, *got, slots)
    assert got_q.shape == q.shape and got_q.is_contiguous() and torch.equal(got_q, want_q)
    for g, w in zip(got, want):
        assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0))
    out = torch.empty_like(want_q)
    assert rope_store_kv(q, k, v, positions, cos, sin, *got, slots, out=out) is out and torch.equal(
        out, want_q
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "heads", "kv_heads", "head_dim"), [(1, 4, 2, 16), (9, 6, 2, 24), (5, 3, 1, 64)]
)
def test_rope_store_kv(
    t: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    check_fused(max(t, 2), heads, kv_heads, head_dim, dtype, seed=t + head_dim)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 256, 8192])
def test_gpu_rope_llama(t: int) -> None:
    check(t, 32, 8, 128, torch.bfloat16, seed=t, device="cuda")
    check_fused(max(t, 2), 32, 8, 128, torch.bfloat16, seed=t, device="cuda")
