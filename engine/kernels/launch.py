"""What it costs the host to launch a kernel: integer helpers for launch parameters, and Launches,
which relaunches a step's kernels without the JIT's argument binding.

triton.next_power_of_2 and triton.cdiv are constexpr functions in recent Triton: a call from host
code costs many times the arithmetic itself (docs/gpu.md#measurements-behind-the-code), and an eager
step needs hundreds. The kernels' host wrappers use these instead, and cache what depends only on a
step's shape.
"""

from __future__ import annotations

from typing import Any

from triton import knobs
from triton.runtime.driver import driver


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    """a / b rounded up."""
    return -(-a // b)


class Consts:
    """A launch's constexprs and options (num_warps, num_stages), made once per shape: Launches
    tells launches apart by this object's identity."""

    __slots__ = ("kwargs", "_values")

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self._values: dict[int, tuple] = {}

    def values(self, kernel: Any) -> tuple:
        """The constexprs' values in the kernel's signature order (the launcher takes every
        argument, constexprs included; options are not arguments)."""
        values = self._values.get(id(kernel))  # by id: a JITFunction hashes its source
        if values is None:
            values = self._values[id(kernel)] = tuple(
                self.kwargs[n] for n in kernel.arg_names if n in self.kwargs
            )
        return values


class Launches:
    """A step's Triton launches: the first launch of each kind goes through the JIT, which binds and
    specializes the arguments, finds (or compiles) the kernel and launches it; a later launch of the
    same kernel with the same grid, integer scalars and constants, whose tensors are 16-byte
    aligned as the first's were, calls the compiled kernel's launcher directly, for a fraction of
    the JIT's host time (docs/gpu.md#measurements-behind-the-code). A kernel's arguments must be
    its tensors, then its scalars, then its constexprs, in that order. Made anew for every step (or
    captured graph): within one, a kind's tensors keep their dtypes and strides (the layers' views
    of one layout), so grid, integer scalars and constants identify the compiled kernel, and every
    launch goes to one stream. Under Triton's interpreter, or with a launch hook set (a profiler),
    every launch goes through the JIT."""

    __slots__ = ("compiled", "stream")

    def __init__(self) -> None:
        self.compiled: dict[tuple, Any] = {}
        self.stream: int | bool | None = (
            None  # the step's stream, read at its first relaunch (False: relaunch none)
        )

    def __call__(
        self, kernel: Any, grid: tuple[int, ...], tensors: tuple, scalars: tuple, consts: Consts
    ) -> None:
        # by id: a JITFunction hashes its source. Triton specializes integers (1, multiples of 16)
        # but never a float's value, so floats (an FP8 pool's per-layer scales) stay out of the key.
        specialized = tuple(float if isinstance(v, float) else v for v in scalars)
        key = (id(kernel), grid, specialized, consts)
        compiled = self.compiled.get(key)
        if compiled is not None and _aligned(tensors):
            if self.stream is None:
                device = driver.active.get_current_device()
                self.stream = (
                    driver.active.get_current_stream(device) if _no_launch_hook() else False
                )
            if self.stream is not False:
                compiled.run(
                    *grid,
                    *(1,) * (3 - len(grid)),
                    self.stream,
                    compiled.function,
                    compiled.packed_metadata,
                    None,
                    None,
                    knobs.runtime.launch_exit_hook,
                    *tensors,
                    *scalars,
                    *consts.values(kernel),
                )
                return
        launched = kernel[grid](*tensors, *scalars, **consts.kwargs)
        if compiled is None and hasattr(launched, "packed_metadata") and _aligned(tensors):
            self.compiled[key] = launched


def launch(
    launches: Launches | None,
    kernel: Any,
    grid: tuple[int, ...],
    tensors: tuple,
    scalars: tuple,
    consts: Consts,
) -> None:
    """Launch kernel through the step's Launches, or through the JIT where there is none (a kernel
    called on its own: tests, benchmarks)."""
    if launches is None:
        kernel[grid](*tensors, *scalars, **consts.kwargs)
    else:
        launches(kernel, grid, tensors, scalars, consts)


def _no_launch_hook() -> bool:
    """No profiler asks for launch metadata (Triton 3.6 keeps an empty HookChain where 3.9 keeps
    None)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is None or not getattr(hook, "calls", True)


def _aligned(tensors: tuple) -> bool:
    for t in tensors:
        if t.data_ptr() & 15:
            return False
    return True
