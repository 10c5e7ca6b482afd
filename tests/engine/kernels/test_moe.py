"""The mixture-of-experts kernels (engine/kernels/moe.py) against float64 references: the router's
choice, the align step's grouping, and the whole layer; the CPU path (engine/ops.py) against the
same reference. Small shapes run everywhere (on the CPU under TRITON_INTERPRET=1); Qwen3-30B-A3B's
shapes need the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.cpu_linear import CpuOps
from engine.kernels.moe import align, fused_moe, moe_config, padded_rows, route
from engine.ops import Experts, TorchOps
from engine.ops import route as torch_route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def reference_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    p = torch.softmax(logits.double(), dim=-1)
    weights, ids = p.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def reference_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """Every token through each of its chosen experts in float64, weighted and summed."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return out


def random_layer(t: int, hidden: int, width: int, experts: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * width, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, width, generator=gen) / width**0.5
    logits = 2 * torch.randn(t, experts, generator=gen)
    return (v.to(DEVICE, dtype) for v in (x, w13, w2, logits))


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (6, 3), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_softmax_top_k(experts: int, top_k: int, renormalize: bool) -> None:
    logits = 2 * torch.randn(37, experts, generator=torch.Generator().manual_seed(experts))
    ref_w, ref_ids = reference_route(logits, top_k, renormalize)
    for weights, ids in (
        route(logits.to(DEVICE), top_k, renormalize),
        torch_route(logits, top_k, renormalize),
    ):
        assert torch.equal(ids.cpu(), ref_ids), "the same experts, best first"
        assert weights.dtype == torch.float32
        torch.testing.assert_close(weights.cpu().double(), ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(1, 2, 8, 16), (5, 3, 6, 16), (70, 8, 128, 16), (300, 2, 8, 64), (129, 4, 60, 32)],
)
def test_align_groups_entries_by_expert(
    tokens: int, top_k: int, experts: int, block_m: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    # skewed: some experts take many entries, some none
    ids = torch.multinomial(
        torch.rand(experts, generator=gen) ** 3, tokens * top_k, replacement=True, generator=gen
    ).view(tokens, top_k)
    entries = ids.numel()
    aligned = align(ids.to(DEVICE), experts, block_m)
    rows, blocks = aligned.sorted.cpu().tolist(), aligned.block_expert.cpu().tolist()
    assert len(rows) == padded_rows(entries, experts, block_m)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    assert int(aligned.num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    flat = ids.flatten().tolist()
    real = [r for r in rows if r != entries]
    assert sorted(real) == list(range(entries)), "every entry once; the rest is the sentinel"
    for b in range(int(aligned.num_padded) // block_m):
        block = [r for r in rows[b * block_m : (b + 1) * block_m] if r != entries]
        assert all(flat[r] == blocks[b] for r in block), "a block's entries are its expert's"
    seen: list[int] = []
    for r in real:
        if seen and flat[seen[-1]] == flat[r]:
            assert r > seen[-1], "an expert's entries in order (stable)"
        seen.append(r)
    assert all(r == entries for r in rows[int(aligned.num_padded) :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "width", "experts", "top_k", "renormalize"),
    [
        (1, 48, 40, 8, 2, True),
        (7, 64, 24, 6, 3, False),
        (70, 40, 56, 16, 4, True),
        (90, 32, 16, 4, 1, False),
    ],
)
def test_fused_moe_matches_reference(
    tokens: int, hidden: int, width: int, experts: int, top_k: int, renormalize: bool, dtype
) -> None:
    x, w13, w2, logits = random_layer(tokens, hidden, width, experts, dtype, seed=tokens)
    weights, ids = route(logits, top_k, renormalize)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = reference_moe(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    rel = (out.cpu().double() - ref).norm() / ref.norm()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("ops", [TorchOps, CpuOps])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_cpu_moe_matches_reference(ops, tokens: int) -> None:
    x, w13, w2, logits = (
        v.cpu() for v in random_layer(tokens, 64, 32, 8, torch.float32, seed=7 + tokens)
    )
    weights, ids = torch_route(logits, 2, True)
    out = ops.moe(x, Experts.of(w13, w2), weights, ids)
    ref = reference_moe(x, w13, w2, weights, ids)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_tiles_follow_the_entry_count() -> None:
    assert moe_config(8, torch.bfloat16).block_m == 16  # decode: short runs per expert
    assert moe_config(4096 * 8, torch.bfloat16).block_m == 128  # a 4K prefill
    assert moe_config(8, torch.float32).block_k == moe_config(8, torch.bfloat16).block_k // 2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gpu_fused_moe_qwen3_30b_shapes(tokens: int) -> None:
    """Qwen3-30B-A3B's layer (128 experts of width 768 over hidden 2048, 8 a token, renormalised)
    in bfloat16 against the float32 torch path on the same weights."""
    x, w13, w2, logits = random_layer(tokens, 2048, 768, 128, torch.bfloat16, seed=tokens)
    weights, ids = route(logits, 8, True)
    out = fused_moe(x, w13, w2, weights, ids).float()
    ref = TorchOps.moe(x.float(), Experts.of(w13.float(), w2.float()), weights, ids)
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2
