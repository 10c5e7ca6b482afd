"""rms_norm and add_rms_norm against float64 references of engine/model.py's RMSNorm."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from engine.kernels.norm import add_rms_norm, add_rms_norm_, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def reference(s: Tensor, weight: Tensor) -> Tensor:
    h = s.double()
    return weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


def assert_close(out: Tensor, ref: Tensor) -> None:
    assert not out.isnan().any()
    # float32 to the brief's 1e-5; bf16 to two units in the last place (the reference rounds twice
    # as well).
    tol = 1e-5 if out.dtype == torch.float32 else 2**-6
    err = (out.double() - ref).abs()
    assert (err <= tol * (1 + ref.abs())).all(), f"max error {err.max().item():.2e}"


def inputs(
    n: int, d: int, dtype: torch.dtype, seed: int, device: str = DEVICE
) -> tuple[Tensor, Tensor, Tensor]:
    """x as a strided view (every other row of a wider buffer), residual, and a weight away from
    1."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(2 * n, d + 3, generator=gen)).to(device, dtype)[::2, :d]
    residual = torch.randn(n, d, generator=gen).to(device, dtype)
    weight = (1 + 0.5 * torch.randn(d, generator=gen)).to(device, dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "d"), [(1, 64), (37, 24), (5, 1000), (300, 16)])
def test_rms_norm(n: int, d: int, dtype: torch.dtype) -> None:
    x, _, weight = inputs(n, d, dtype, seed=n * d)
    out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, reference(x, weight))


def test_rms_norm_per_head_of_strided_3d_view() -> None:
    """Qwen3's q/k norm: [T, H, D] heads sliced out of a fused qkv output (row stride > H * D)."""
    gen = torch.Generator().manual_seed(4)
    t, h, d = 7, 3, 32
    qkv = torch.randn(t, (h + 4) * d, generator=gen).to(DEVICE)
    q = qkv[:, : h * d].view(t, h, d)
    weight = torch.randn(d, generator=gen).to(DEVICE)
    out = rms_norm(q, weight, EPS)
    assert out.shape == (t, h, d)
    assert_close(out, reference(q, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "d"), [(1, 64), (37, 24), (5, 1000)])
def test_add_rms_norm(n: int, d: int, dtype: torch.dtype) -> None:
    x, residual, weight = inputs(n, d, dtype, seed=n + d)
    out, s = add_rms_norm(x, residual, weight, EPS)
    total = x.double() + residual.double()
    # s is x + residual rounded once to the dtype (the interpreter truncates where the GPU rounds to
    # nearest).
    torch.testing.assert_close(
        s.double(), total, rtol=0 if dtype == torch.float32 else 2**-7, atol=1e-6
    )
    assert_close(out, reference(s, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "d"), [(1, 64), (37, 24), (5, 1000)])
def test_add_rms_norm_in_place_equals_the_out_of_place_one(
    n: int, d: int, dtype: torch.dtype
) -> None:
    """The engine's residual stream: the sum goes into residual and the output into x, bit for bit
    add_rms_norm's."""
    x, residual, weight = inputs(n, d, dtype, seed=n * 3 + d)
    x = x.contiguous()
    want_out, want_s = add_rms_norm(x, residual, weight, EPS)
    got_out, got_s = add_rms_norm_(x, residual, weight, EPS)
    assert got_out.data_ptr() == x.data_ptr() and got_s.data_ptr() == residual.data_ptr()
    assert torch.equal(got_out, want_out) and torch.equal(got_s, want_s)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 256, 8192])
def test_gpu_norms_llama(n: int) -> None:
    x, residual, weight = inputs(n, 4096, torch.bfloat16, seed=n, device="cuda")
    assert_close(rms_norm(x, weight, EPS), reference(x, weight))
    out, s = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(s, x + residual), "bf16 add rounds to nearest on the GPU, as torch's does"
    assert_close(out, reference(s, weight))
    x = x.contiguous()
    got_out, got_s = add_rms_norm_(x, residual, weight, EPS)
    assert torch.equal(got_out, out) and torch.equal(got_s, s)
