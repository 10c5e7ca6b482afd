"""An fp8 (e4m3) KV pool under a model of another dtype: the torch reference's store (each value
over its layer's scale, saturated at 448) and attention (against float64 attention over the
dequantized pool), the Triton kernels (store, RoPE fused with the store, the decode and general
grids, split or not, in one launch or two) against the torch reference over the same pool, and the
CPU backend's refusal.

Scales 0.05 (keys) and 3.0 (values) put keys high and values low in e4m3's range. Under Triton's
interpreter a float32 -> e4m3 cast is patched to round as the GPU does (tests/conftest.py,
interpreter_rounds_fp8).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor

from engine.attention import AttentionShape, StepBatch, triton_backend
from engine.attention.cpu_backend import CpuBackend
from engine.attention.torch_backend import TorchBackend, to_cache
from engine.attention.torch_backend import store_kv as reference_store
from engine.attention.triton_backend import TritonBackend
from engine.kernels.rope import apply_rope, rope_store_kv
from engine.kernels.store_kv import store_kv
from tests.engine.kernels.test_attention import Batch, assert_close, make_batch, reference
from tests.engine.kernels.test_rope import rope_inputs
from tests.engine.test_triton_backend import decodes, step_of

FP8 = torch.float8_e4m3fn
KS, VS = 0.05, 3.0
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 16
SHAPE = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, BLOCK, max_blocks_per_seq=64)
SCALE = HEAD_DIM**-0.5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def as_bytes(x: Tensor) -> Tensor:
    return x.view(torch.uint8)


def fp8_step(
    seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int
) -> tuple[Batch, StepBatch, Tensor, Tensor]:
    """A step over seqs ((cached, new) tokens, decodes first) in test_attention's random pool of
    GQA heads, and its new tokens' keys and values (those at their slots of the pool)."""
    batch = make_batch(
        seqs,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        dtype=dtype,
        seed=seed,
        device=DEVICE.type,
    )
    return batch, *step_of(batch, decodes(seqs))


def fp8_pools(batch: Batch) -> tuple[Tensor, Tensor]:
    """batch's K and V caches quantized (their NaN slots, no key of any sequence, stay NaN)."""
    return to_cache(batch.k_cache, FP8, KS), to_cache(batch.v_cache, FP8, VS)


def clones(pools: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return pools[0].clone(), pools[1].clone()


def with_extremes(x: Tensor, scale: float) -> Tensor:
    """x with values far past e4m3's range x scale at both signs, one just past it, and a negative
    zero."""
    x = x.clone()
    x[0, 0, :4] = torch.tensor([1e4 * scale, -1e4 * scale, 460 * scale, -0.0])
    return x


# ---- the torch reference -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_store_divides_by_the_scale_and_saturates(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k = with_extremes(torch.randn(24, KV_HEADS, HEAD_DIM, generator=gen), KS).to(DEVICE, dtype)
    v = with_extremes(4 * torch.randn(24, KV_HEADS, HEAD_DIM, generator=gen), VS).to(DEVICE, dtype)
    slots = torch.randperm(64, generator=gen)[:24].to(DEVICE)
    pools = [torch.zeros(64, KV_HEADS, HEAD_DIM, dtype=FP8, device=DEVICE) for _ in range(2)]
    reference_store(k, v, *pools, slots, (KS, VS))
    for pool, x, s in ((pools[0], k, KS), (pools[1], v, VS)):
        x64 = x.double()
        # The quotient in float64: the stores' float32 product with the reciprocal differs from it
        # only within 2^-22 of a midpoint between two e4m3 values.
        want = (x64 / s).clamp(-448, 448).to(FP8)
        assert torch.equal(as_bytes(pool[slots]), as_bytes(want))
        stored = pool[slots].double() * s
        assert not stored.isnan().any()
        saturated = x64.abs() > 448 * s
        assert saturated.sum() >= 3
        assert torch.equal(stored[saturated], 448 * s * x64[saturated].sign())
        # Within half a step of e4m3 (3 mantissa bits; subnormal steps of 2^-9 x the scale).
        err, size = (stored - x64)[~saturated].abs(), x64[~saturated].abs()
        assert (err <= torch.clamp(size * 2**-4, min=2**-10 * s) * (1 + 1e-9)).all()
    assert as_bytes(pools[0][slots[0], 0, 3]).item() == 0x80, "a negative zero keeps its sign"


# (cached, new) tokens per sequence, the sequences of one new token first.
REFERENCE_STEPS = {
    "prefill": [(0, 13), (0, 5)],
    "append": [(37, 6), (20, 9)],
    "decode": [(40, 1), (17, 1), (0, 1)],
}


@pytest.mark.parametrize("name", REFERENCE_STEPS)
def test_the_reference_attends_over_the_dequantized_pool(name: str) -> None:
    """The torch backend over an fp8 pool (float32 model) against float64 attention over the pool's
    keys and values times their scales; GQA (two query heads per KV head)."""
    seqs = REFERENCE_STEPS[name]
    batch, step, k, v = fp8_step(seqs, torch.float32, seed=len(name))
    pools = fp8_pools(batch)  # the step's new keys and values included
    k64, v64 = (pool.double() * s for pool, s in zip(pools, (KS, VS)))
    want = reference(replace(batch, k_cache=k64, v_cache=v64), SCALE)
    backend = TorchBackend(SHAPE, DEVICE)
    out = backend.forward(batch.q, k, v, *pools, backend.prepare(step), SCALE, kv_scales=(KS, VS))
    assert out.dtype == torch.float32 and want.abs().max() > 1.0
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# ---- the Triton kernels against the reference ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_references_bytes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(23, 4 * KV_HEADS * HEAD_DIM, generator=gen)
    k = qkv[:, : KV_HEADS * HEAD_DIM].view(23, KV_HEADS, HEAD_DIM)  # strided, as the model's
    v = 4 * qkv[:, KV_HEADS * HEAD_DIM : 2 * KV_HEADS * HEAD_DIM].view(23, KV_HEADS, HEAD_DIM)
    k, v = with_extremes(k, KS).to(DEVICE, dtype), with_extremes(v, VS).to(DEVICE, dtype)
    slots = torch.randperm(64, generator=gen)[:23]
    slots[torch.rand(23, generator=gen) < 0.25] = -1  # padded rows
    slots[0] = 5  # the row of extremes is stored
    slots = slots.to(DEVICE)
    sentinel = torch.full((64, KV_HEADS, HEAD_DIM), 7.0, device=DEVICE).to(FP8)
    got, want = [sentinel.clone() for _ in range(2)], [sentinel.clone() for _ in range(2)]
    store_kv(k, v, *got, slots.int(), (KS, VS))
    kept = slots >= 0
    reference_store(k[kept], v[kept], *want, slots[kept], (KS, VS))
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g), as_bytes(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_writes_what_apply_rope_then_the_reference_store_write(
    dtype: torch.dtype,
) -> None:
    t = 9
    q, k, v, positions, cos, sin = rope_inputs(t, HEADS, KV_HEADS, HEAD_DIM, dtype, seed=3)
    k, v = 20 * k, 4 * v  # keys into e4m3's top (past 448 x 0.05: saturated)
    slots = torch.randperm(3 * t, generator=torch.Generator().manual_seed(3))[:t].to(DEVICE)
    slots[t // 2] = -1
    nan = torch.full((3 * t, KV_HEADS, HEAD_DIM), float("nan"), device=DEVICE).to(FP8)
    got, want = [nan.clone() for _ in range(2)], [nan.clone() for _ in range(2)]
    want_q, want_k = apply_rope(q, k, positions, cos, sin)
    kept = slots >= 0
    reference_store(want_k[kept], v[kept], *want, slots[kept], (KS, VS))
    got_q = rope_store_kv(q, k, v, positions, cos, sin, *got, slots, kv_scales=(KS, VS))
    assert torch.equal(got_q, want_q)
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g), as_bytes(w))
    assert (want_k.float().abs() > 448 * KS).any(), "some keys saturate"


# (cached, new) tokens per sequence, decodes first; the KV splits the Triton backend gives the
# decode and the general grid (an H100's: TritonBackend off CUDA).
STEPS = {
    "decode": ([(40, 1), (9, 1)], 1, 1),
    "decode split": ([(520, 1), (40, 1)], 2, 1),
    "prefill": ([(0, 12), (30, 5)], 1, 1),
    "decode and append split, prompt": ([(520, 1), (3, 1), (600, 8), (0, 9)], 2, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", STEPS)
def test_triton_attention_matches_the_reference_over_one_fp8_pool(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both backends store the step's K/V into copies of one fp8 pool (the same bytes) and attend; a
    step with decodes beside other sequences in one launch and in two (MIXED_LAUNCH)."""
    seqs, decode_splits, general_splits = STEPS[name]
    batch, step, k, v = fp8_step(seqs, dtype, seed=len(name))
    pools = fp8_pools(batch)
    want_pools = clones(pools)
    torch_backend = TorchBackend(SHAPE, DEVICE)
    want = torch_backend.forward(
        batch.q, k, v, *want_pools, torch_backend.prepare(step), SCALE, kv_scales=(KS, VS)
    )
    mixed = 0 < decodes(seqs) < len(seqs)
    for mode in ("sequential", "fused") if mixed else ("sequential",):
        monkeypatch.setattr(triton_backend, "MIXED_LAUNCH", mode)
        got_pools = clones(pools)
        backend = TritonBackend(SHAPE, DEVICE)
        meta = backend.prepare(step)
        assert (meta.num_splits, meta.general_splits) == (decode_splits, general_splits)
        out = backend.forward(batch.q, k, v, *got_pools, meta, SCALE, kv_scales=(KS, VS))
        for g, w in zip(got_pools, want_pools):
            assert torch.equal(as_bytes(g), as_bytes(w))
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        else:  # the reference rounds the dequantized keys and values to bfloat16
            assert_close(out, want.double())


def test_triton_rope_and_attend_passes_the_scales() -> None:
    """The layer's call: RoPE fused with the store, then attention, against the reference's RoPE,
    store and attention (float32; their RoPE may differ in a last bit, so one e4m3 step)."""
    seqs = STEPS["decode split"][0]
    batch, step, k, v = fp8_step(seqs, torch.float32, seed=5)
    cos, sin = rope_inputs(1, HEADS, KV_HEADS, HEAD_DIM, torch.float32, 5, DEVICE.type)[-2:]
    positions = torch.tensor(step.positions, device=DEVICE)
    outs = []
    for backend in (TorchBackend(SHAPE, DEVICE), TritonBackend(SHAPE, DEVICE)):
        outs.append(
            backend.rope_and_attend(
                batch.q,
                k,
                v,
                *fp8_pools(batch),
                backend.prepare(step),
                SCALE,
                positions,
                cos,
                sin,
                kv_scales=(KS, VS),
            )
        )
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)


# ---- the CPU backend -----------------------------------------------------------------------------


def test_the_cpu_backend_refuses_an_fp8_pool() -> None:
    seqs = STEPS["decode"][0]
    batch, step, k, v = fp8_step(seqs, torch.float32, seed=6)
    cos, sin = rope_inputs(1, HEADS, KV_HEADS, HEAD_DIM, torch.float32, seed=6, device="cpu")[-2:]
    batch, k, v = replace(batch, q=batch.q.cpu()), k.cpu(), v.cpu()
    pools = [pool.cpu() for pool in fp8_pools(batch)]
    backend = CpuBackend(SHAPE, torch.device("cpu"))
    meta = backend.prepare(step)
    with pytest.raises(ValueError, match="--attention-backend torch"):
        backend.forward(batch.q, k, v, *pools, meta, SCALE, kv_scales=(KS, VS))
    with pytest.raises(ValueError, match="--attention-backend torch"):
        backend.rope_and_attend(
            batch.q,
            k,
            v,
            *pools,
            meta,
            SCALE,
            torch.tensor(step.positions),
            cos,
            sin,
            kv_scales=(KS, VS),
        )
