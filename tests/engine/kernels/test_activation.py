"""silu_and_mul against float64 silu(gate) * up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.activation import silu_and_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# unwritten outputs NaN (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def check(n: int, inner: int, dtype: torch.dtype, seed: int, device: str = DEVICE) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Rows strided: x is the left part of a wider buffer. Scale 4 reaches silu's saturating tails.
    x = (4 * torch.randn(n, 2 * inner + 5, generator=gen)).to(device, dtype)[:, : 2 * inner]
    out = silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert out.shape == (n, inner) and out.dtype == dtype and not out.isnan().any()
    err = out.double() - ref
    rel_tol = 4e-6 if dtype == torch.float32 else 1e-2
    assert (err.norm() / ref.norm()).item() < rel_tol
    assert (err.abs() <= rel_tol * ref.abs() + 1e-6).all(), (
        "every element within rounding of the reference"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "inner"), [(1, 40), (13, 96), (3, 1500)])
def test_silu_and_mul(n: int, inner: int, dtype: torch.dtype) -> None:
    check(n, inner, dtype, seed=n + inner)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 256, 8192])
def test_gpu_silu_and_mul_llama(n: int) -> None:
    check(n, 14336, torch.bfloat16, seed=n, device="cuda")
