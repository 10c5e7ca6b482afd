"""SwiGLU's activation: silu(gate) * up in one pass over the fused gate|up projection output.

Contract: x [N, 2I] holds gate in columns [0, I) and up in [I, 2I) (rows may be strided, last dim
contiguous); the result [N, I] = silu(gate) * up is computed in float32 and rounded once to x's
dtype.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.launch import Consts, Launches, cdiv, launch, next_power_of_2

BLOCK_COLS = 1024  # output columns per program: 14336-wide rows (Llama-3.1-8B) take 14 programs


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * INTER + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def _launch_shape(i: int, num_warps: int | None) -> tuple[int, Consts]:
    """(programs per row, constants) for rows of i outputs."""
    block = min(next_power_of_2(i), BLOCK_COLS)
    return cdiv(i, block), Consts(
        INTER=i, BLOCK=block, num_warps=num_warps or min(max(block // 256, 1), 8)
    )


def silu_and_mul(
    x: Tensor, *, num_warps: int | None = None, launches: Launches | None = None
) -> Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I], a new contiguous tensor of x's dtype.
    launches: the step's (engine/kernels/launch.py)."""
    n, two_i = x.shape
    assert two_i % 2 == 0 and x.stride(1) == 1, "x must be [N, 2I] with a contiguous last dim"
    i = two_i // 2
    out = torch.empty(n, i, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    programs, consts = _launch_shape(i, num_warps)
    launch(launches, _silu_and_mul_kernel, (n, programs), (x, out), (x.stride(0),), consts)
    return out
