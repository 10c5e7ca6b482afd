"""The overlap probe's unit of work: a Triton kernel doing a fixed amount of arithmetic in a few thread blocks.

Unlike torch.cuda._sleep, which waits until the SM clock has advanced by a number of cycles, it needs its SMs
for its whole length: two of them time-sliced take twice as long as one, two running side by side do not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


# iters is not specialised: otherwise a new value (divisible by 16 or not) would compile a new variant mid-timing.
@triton.jit(do_not_specialize=["iters"])
def _spin_kernel(out_ptr, iters, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = offsets.to(tl.float32)
    for _ in range(iters):
        x = x * 0.999999 + 1.0  # a dependent chain: no way to skip iterations
    tl.store(out_ptr + offsets, x)


def spin(out: torch.Tensor, iters: int) -> None:
    """Enqueue iters dependent multiply-adds per element of out (float32, a multiple of BLOCK long), one program
    of BLOCK elements per BLOCK of out, on the current stream."""
    _spin_kernel[(out.numel() // BLOCK,)](out, iters, BLOCK=BLOCK, num_warps=4)
