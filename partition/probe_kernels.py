"""The probes' kernels. spin, the overlap probe's unit of work: a fixed amount of arithmetic in a
few thread blocks. Unlike torch.cuda._sleep, which waits until the SM clock has advanced by a
number of cycles, it needs its SMs for its whole length: two of them time-sliced take twice as
long as one, two running side by side do not.

sm_ids: which SMs a stream's work really runs on (each program reads the PTX register %smid), the
evidence that two green-context groups are disjoint on the device rather than in the driver's
numbers. Not for the interpreter, which runs no inline assembly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


# iters is not specialised: otherwise a new value (divisible by 16 or not) would compile a new
# variant mid-timing.
@triton.jit(do_not_specialize=["iters"])
def _spin_kernel(out_ptr, iters, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = offsets.to(tl.float32)
    for _ in range(iters):
        x = x * 0.999999 + 1.0  # a dependent chain: no way to skip iterations
    tl.store(out_ptr + offsets, x)


def spin(out: torch.Tensor, iters: int) -> None:
    """Enqueue iters dependent multiply-adds per element of out (float32, a multiple of BLOCK long),
    one program of BLOCK elements per BLOCK of out, on the current stream."""
    _spin_kernel[(out.numel() // BLOCK,)](out, iters, BLOCK=BLOCK, num_warps=4)


# one warp per program: many programs fit on each SM, so a launch reaches every SM it may use
SM_ID_BLOCK = 32


@triton.jit(do_not_specialize=["iters"])
def _sm_ids_kernel(sm_ptr, work_ptr, iters, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = offsets.to(tl.float32)
    for _ in range(iters):
        x = (
            x * 0.999999 + 1.0
        )  # holds the SM a while, so that the programs spread over every SM the stream may use
    sm = tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.store(sm_ptr + tl.program_id(0), sm)
    tl.store(
        work_ptr + tl.program_id(0) * BLOCK + offsets, x
    )  # the loop's result is used: it is not optimised away


def sm_ids(programs: int, iters: int = 2000) -> torch.Tensor:
    """Enqueue programs one-warp programs on the current stream (also inside a CUDA-graph capture);
    returns an int32 CUDA tensor [programs] of the SM each ran on, valid once the stream has run
    them."""
    sm = torch.empty(programs, dtype=torch.int32, device="cuda")
    work = torch.empty(programs * SM_ID_BLOCK, dtype=torch.float32, device="cuda")
    _sm_ids_kernel[(programs,)](sm, work, iters, BLOCK=SM_ID_BLOCK, num_warps=1)
    return sm
