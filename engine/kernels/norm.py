"""RMSNorm, and RMSNorm fused with the residual add, as one kernel each.

Contract (engine/model.py's RMSNorm): h = s.float(); h = h * rsqrt(mean(h^2) + eps); out = weight *
h.to(dtype), with s = x (rms_norm) or s = x + residual rounded to x's dtype (add_rms_norm, which
also returns s as the new residual stream). Reductions and products run in float32; the same
roundings as the reference are applied, so float32 inputs match it to float32 rounding and
low-precision inputs to about one unit in the last place.

add_rms_norm_ is add_rms_norm in place, as vLLM's fused_add_rms_norm: s goes into residual and the
normalised output into x, so the model's residual stream allocates nothing per layer.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.launch import Consts, Launches, cdiv, launch, next_power_of_2

ROW_BLOCK_ELEMENTS = (
    2048  # elements one program normalises: several short rows (per-head q/k norm) or one long one
)


@triton.jit(
    do_not_specialize=["n_rows"]
)  # the token count changes every step: one compiled variant
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_rows,
    heads,
    stride_x0,
    stride_x1,
    stride_r0,
    eps,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ADD: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    # Rows of a 3-D input [N, heads, D] are (token, head) pairs with two strides; 2-D inputs have
    # heads == 1.
    x_off = (rows // heads * stride_x0 + rows % heads * stride_x1)[:, None] + cols[None, :]
    s = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(res_ptr + rows[:, None] * stride_r0 + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        # The reference adds in the model dtype: round the sum before normalising it.
        s = (s + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * D + cols[None, :], s, mask=mask)
        s = s.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, 1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    h = (s * inv_rms[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * D + cols[None, :],
        (h * w[None, :]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@lru_cache(maxsize=4096)
def _launch_shape(n_rows: int, d: int, add: bool, num_warps: int | None) -> tuple[int, Consts]:
    """(programs, constants) for n_rows rows of d elements."""
    block_d = next_power_of_2(d)
    block_n = min(max(ROW_BLOCK_ELEMENTS // block_d, 1), next_power_of_2(n_rows))
    warps = num_warps or min(max(block_n * block_d // 512, 1), 16)
    return cdiv(n_rows, block_n), Consts(
        D=d, BLOCK_N=block_n, BLOCK_D=block_d, ADD=add, num_warps=warps
    )


def _launch(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    out: Tensor,
    s: Tensor,
    num_warps: int | None,
    launches: Launches | None = None,
) -> None:
    three_d = x.dim() == 3
    n_rows = x.shape[0] * x.shape[1] if three_d else x.shape[0]
    if n_rows == 0:
        return
    programs, consts = _launch_shape(n_rows, x.shape[-1], residual is not None, num_warps)
    tensors = (x, residual if residual is not None else x, weight, out, s)
    scalars = (
        n_rows,
        x.shape[1] if three_d else 1,
        x.stride(0),
        x.stride(1) if three_d else 0,
        residual.stride(0) if residual is not None else 0,
        eps,
    )
    launch(launches, _rms_norm_kernel, (programs,), tensors, scalars, consts)


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    *,
    num_warps: int | None = None,
    launches: Launches | None = None,
) -> Tensor:
    """RMSNorm over the last dim of x [N, D] or [N, heads, D] (leading strides arbitrary, last dim
    contiguous); returns a new contiguous tensor of x's shape and dtype. launches: the step's
    (engine/kernels/launch.py)."""
    assert x.dim() in (2, 3), "x must be [N, D] or [N, heads, D]"
    assert x.stride(-1) == 1 and weight.shape == (x.shape[-1],) and weight.is_contiguous(), (
        "last dim must be contiguous"
    )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, out, num_warps, launches)
    return out


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, num_warps: int | None = None
) -> tuple[Tensor, Tensor]:
    """(rms_norm(s), s) with s = x + residual ([N, D], stored in x's dtype): one read of each input,
    one launch."""
    assert x.dim() == 2 and residual.shape == x.shape and residual.stride(-1) == 1
    assert x.stride(-1) == 1 and weight.shape == (x.shape[-1],) and weight.is_contiguous(), (
        "last dim must be contiguous"
    )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, s, num_warps)
    return out, s


def add_rms_norm_(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, launches: Launches | None = None
) -> tuple[Tensor, Tensor]:
    """add_rms_norm in place: residual becomes s and x its normalised output; returns (x, residual).
    Both must be contiguous [N, D] of one dtype (the model's hidden states always are: checked once
    per model, not per call)."""
    _launch(x, residual, weight, eps, x, residual, None, launches)
    return x, residual
