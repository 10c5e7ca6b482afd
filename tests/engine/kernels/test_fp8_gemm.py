"""The FP8 linear kernels (engine/kernels/fp8.py) under Triton's interpreter, against the torch
reference (engine.quant) and against float64 math on the dequantized operands.

Tolerances: e4m3 values have 4 significant bits, so the product of two (and of an e4m3 value and a
bfloat16 or float16 one) is exact in float32; the kernels and the reference differ only in the order
of their float32 sums and the final rounding. Against the float64 result `exact` of the same e4m3
operands and scales, every float32 addition or scaling errs by at most 2^-24 of the magnitude
`mag` = sum |x_k w_k| (+ |bias|), and there are at most K + 3G + 4 of them (the sums over K and over
the groups, two scalings a group, the bias); a float32 x's products round once each, 2^-24 mag
more. Then one rounding to the output dtype (its unit roundoff u times |exact|):
bound = u |exact| + (K + 3G + 5) 2^-24 mag. The quantizer is exact: its bytes and scales equal
engine.quant.quantize's.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import quant
from engine.kernels.fp8 import (
    FP8_CONFIGS,
    fp8_config,
    fp8_gemm,
    fp8_linear,
    quantize_activations,
    scaled_mm_linear,
    scaled_mm_serves,
)
from engine.kernels.launch import Launches
from engine.quant import Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter rounds float32 to bfloat16 toward zero (the GPU to nearest): a whole unit in
# the last place there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
UNIT_ROUNDOFF = {
    torch.bfloat16: 2.0 ** (-7 if INTERPRETED else -8),
    torch.float16: 2.0**-11,
    torch.float32: 2.0**-24,
}
N = 72  # output columns: not a multiple of any tile's

# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def weight(n: int, k: int, group: int, activations: str = "dynamic", seed: int = 0) -> Fp8Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    data, scale = quant.quantize(w, group)
    return Fp8Weight(data.to(DEVICE), scale.to(DEVICE), group, activations)


def inputs(m: int, k: int, dtype: torch.dtype, bias: bool, n: int = N, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, b


def exact(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None):
    """(the float64 result over the operands as the kernels see them, the magnitude of its
    terms)."""
    k = x.shape[1]
    if w.activations == "dynamic":
        xq, xs = quant.quantize(x.cpu(), w.group)
        xd = xq.double() * quant.expand_scale(xs, w.group, k).double()
    else:
        xd = x.cpu().double()
    wd = w.data.cpu().double() * quant.expand_scale(w.scale.cpu(), w.group, k).double()
    out, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        out, mag = out + bias.cpu().double(), mag + bias.cpu().double().abs()
    return out, mag


def bound(x: torch.Tensor, w: Fp8Weight, out: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    k, groups = x.shape[1], w.scale.shape[1]
    return UNIT_ROUNDOFF[x.dtype] * out.abs() + (k + 3 * groups + 5) * 2.0**-24 * mag


def check(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, got: torch.Tensor) -> None:
    """got within bound of the float64 result, and of the torch reference (which is within it too;
    W8A16's reference rounds the dequantized weight to x's dtype first: u of mag more)."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.data.shape[0])
    want, mag = exact(x, w, bias)
    tol = bound(x, w, want, mag)
    err = (got.cpu().double() - want).abs()
    assert (err <= tol).all(), f"off by {(err / tol).max():.2f}x the bound"
    ref = quant.fp8_linear(
        x.cpu(),
        Fp8Weight(*(t.cpu() for t in (w.data, w.scale)), w.group, w.activations),
        None if bias is None else bias.cpu(),
    )
    ref_tol = tol + (UNIT_ROUNDOFF[x.dtype] * mag if w.activations == "none" else 0)
    assert ((got.cpu().double() - ref.double()).abs() <= tol + ref_tol).all()


# ---- the activations' quantizer ------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize(
    ("m", "k", "group"),
    [(1, 160, 160), (5, 160, 32), (33, 100, 48), (3, 300, 256), (2, 5000, 5000)],
    ids=["per-channel", "group-32", "group-48-ragged", "group-256-ragged", "wider-than-a-tile"],
)
def test_quantizer_matches_reference_bytes(dtype, m: int, k: int, group: int) -> None:
    x = (3 * torch.randn(m, k, generator=torch.Generator().manual_seed(k))).to(DEVICE, dtype)
    data, scale = quantize_activations(x, group)
    want_data, want_scale = quant.quantize(x.cpu(), group)
    assert torch.equal(data.cpu().view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


def test_quantizer_rounds_every_bfloat16_value_to_nearest_even() -> None:
    """Every bfloat16 value up to 448 in magnitude, both signs, zeros among them, in a row whose
    scale is 1 (448 is in it): e4m3's ties, subnormals and -0.0 as torch rounds them. A row of
    zeros takes the least scale. 34,754 columns: the loop over a group wider than a tile."""
    v = torch.arange(0x8000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    v = v[v.abs() <= 448]
    x = torch.stack([torch.cat([v, -v]), torch.zeros(2 * len(v))]).to(DEVICE)
    data, scale = quantize_activations(x, x.shape[1])
    want_data, want_scale = quant.quantize(x.cpu(), x.shape[1])
    assert torch.equal(scale.cpu(), want_scale)
    assert want_scale[0].item() == 1.0 and want_scale[1].item() == torch.tensor(quant.MIN_SCALE)
    assert torch.equal(data.cpu().view(torch.uint8), want_data.view(torch.uint8))


# ---- the GEMM ------------------------------------------------------------------------------------

LAYOUTS = {  # (K, group): per-channel, groups that divide K, a ragged last group
    "per-channel": (160, 160),
    "group-32": (160, 32),
    "group-64-ragged": (160, 64),
}
BF16, FP32 = torch.bfloat16, torch.float32
# Every M with every layout, each in one dtype (each M and each layout sees both); a bias for M 1
# and 33. M 33 takes the medium tile; M 1 and 5 the decode tile.
W8A8_CASES = [
    (1, "per-channel", BF16),
    (1, "group-32", FP32),
    (1, "group-64-ragged", BF16),
    (5, "per-channel", FP32),
    (5, "group-32", BF16),
    (5, "group-64-ragged", FP32),
    (33, "per-channel", BF16),
    (33, "group-32", FP32),
    (33, "group-64-ragged", BF16),
]
W8A16_CASES = [
    (1, "per-channel", FP32),
    (1, "group-32", BF16),
    (5, "per-channel", BF16),
    (5, "group-32", FP32),
    (33, "per-channel", FP32),
    (33, "group-32", BF16),
]


def case_id(case: tuple) -> str:
    m, layout, dtype = case
    return f"m{m}-{layout}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize(("m", "layout", "dtype"), W8A8_CASES, ids=map(case_id, W8A8_CASES))
def test_w8a8_gemm(m: int, layout: str, dtype: torch.dtype) -> None:
    k, group = LAYOUTS[layout]
    w = weight(N, k, group)
    x, bias = inputs(m, k, dtype, bias=m != 5)
    check(x, w, bias, fp8_linear(x, w, bias))


@pytest.mark.parametrize(("m", "layout", "dtype"), W8A16_CASES, ids=map(case_id, W8A16_CASES))
def test_w8a16_gemm(m: int, layout: str, dtype: torch.dtype) -> None:
    k, group = LAYOUTS[layout]
    w = weight(N, k, group, "none")
    x, bias = inputs(m, k, dtype, bias=m != 5)
    check(x, w, bias, fp8_linear(x, w, bias))


def test_tiles_follow_m() -> None:
    """Decode's tile to 16 rows, the medium one to 128, then the prefill tile; W8A16 in float32
    halves K tiles."""
    for m, config in ((1, 0), (16, 0), (17, 1), (128, 1), (129, 2), (8192, 2)):
        assert fp8_config(m, BF16, "dynamic") == FP8_CONFIGS[config]
    assert fp8_config(1, FP32, "none").block_k == FP8_CONFIGS[0].block_k // 2
    assert fp8_config(1, FP32, "dynamic") == FP8_CONFIGS[0]


@pytest.mark.parametrize(
    ("activations", "k", "group"),
    [("dynamic", 160, 160), ("dynamic", 300, 256), ("dynamic", 160, 96), ("none", 300, 256)],
    ids=["w8a8-per-channel", "w8a8-two-tiles-a-group", "w8a8-group-96", "w8a16-groups"],
)
def test_prefill_tile(activations: str, k: int, group: int) -> None:
    """The prefill tile (asked for: the interpreter takes seconds over 129 rows); groups of several
    K tiles (256 = 2 x 128, 96 = 3 x 32)."""
    w = weight(N, k, group, activations)
    x, bias = inputs(5, k, BF16, bias=True)
    check(x, w, bias, fp8_gemm(x, w, bias, config=FP8_CONFIGS[-1]))


def test_m_tiles_in_bands() -> None:
    """33 rows in the decode tile: three M tiles, one band of the grid's M-major order."""
    w = weight(N, 160, 32)
    x, bias = inputs(33, 160, BF16, bias=True)
    check(x, w, bias, fp8_gemm(x, w, bias, config=FP8_CONFIGS[0]))


@pytest.mark.parametrize("activations", ["dynamic", "none"])
def test_float16(activations: str) -> None:
    w = weight(N, 160, 32, activations)
    x, bias = inputs(5, 160, torch.float16, bias=True)
    check(x, w, bias, fp8_linear(x, w, bias, launches=Launches()))


def test_group_narrower_than_a_dot_goes_to_the_reference() -> None:
    w = weight(N, 64, 16)
    x, bias = inputs(3, 64, torch.bfloat16, bias=True)
    got = fp8_gemm(x, w, bias)
    assert torch.equal(got.cpu(), quant.fp8_linear(x.cpu(), w, bias.cpu()))


def test_empty_batch() -> None:
    w = weight(N, 160, 32)
    assert fp8_linear(torch.empty(0, 160, dtype=torch.bfloat16, device=DEVICE), w).shape == (0, N)


# ---- torch._scaled_mm's row-wise path ------------------------------------------------------------


def test_scaled_mm_serves_bfloat16_per_channel_layouts_only() -> None:
    x, bias = inputs(4, 160, torch.bfloat16, bias=True, n=N + 8)
    w = weight(N + 8, 160, 160)  # N = 80, K = 160: multiples of 16
    assert scaled_mm_serves(x, w, bias) and scaled_mm_serves(x, w)
    assert not scaled_mm_serves(x.half(), w)  # float16 out
    assert not scaled_mm_serves(x, w, bias.float())
    assert not scaled_mm_serves(x, weight(N + 8, 160, 32))  # several groups
    assert not scaled_mm_serves(x, weight(N, 160, 160))  # N = 72
    assert not scaled_mm_serves(x[:, :100], weight(N + 8, 100, 100))  # K = 100
    assert not scaled_mm_serves(x, Fp8Weight(w.data, w.scale, w.group, "none"))
    # a fused weight's rows: still row-major, its scales contiguous
    assert scaled_mm_serves(x, Fp8Weight(w.data[16:], w.scale[16:], w.group))


def test_scaled_mm_linear_matches_the_reference() -> None:
    """The GPU's per-channel W8A8 path, run here through the CPU's torch._scaled_mm: operands in
    the layout and scales the GPU gets."""
    w = weight(N + 8, 160, 160)
    for m, bias in ((1, True), (5, False)):
        x, b = inputs(m, 160, torch.bfloat16, bias, n=N + 8)
        check(x, w, b, scaled_mm_linear(x, w, b))
