"""Integer helpers for launch parameters, in plain Python.

triton.next_power_of_2 and triton.cdiv are constexpr functions in recent Triton: a call from host code costs
1.5 us (Triton 3.9) to about 8 us (3.6, seen on the GPU host), against 0.1 us for the arithmetic itself, and an
eager step computed hundreds of them. The kernels' host wrappers use these instead, and cache what depends only
on a step's shape.
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    """a / b rounded up."""
    return -(-a // b)
