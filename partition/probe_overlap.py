"""Do two processes' kernels run at the same time on one GPU? Timed, not assumed.

Two spawned workers initialise CUDA, then take turns (the other waits at a barrier) to calibrate a
kernel that keeps a few SMs busy for about target_ms and time it alone; then both launch it right
after a common barrier and report host start and end times from time.monotonic() (CLOCK_MONOTONIC,
one clock for all processes on Linux, unlike perf_counter's per-process origin).
probe_report.overlap_verdict turns the two sides into ratio = sum of solo durations / span from
first start to last end: about 2 concurrent, about 1 time-sliced.

Two kernels are timed: "spin" (probe_kernels.spin, a fixed amount of arithmetic), which the verdict
uses, and "sleep" (torch.cuda._sleep, a wait for a number of clock cycles), reported for comparison
only: the SM clock keeps counting while another context holds the GPU, so time-sliced sleeps may
finish on time and look concurrent.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from partition.child import SPAWN, Env, Finding, error_text, finish_all, start_child
from partition.driver import mps_enabled
from partition.probe_report import overlap_verdict

KERNELS = ("spin", "sleep")
MIN_CALIBRATION_S = (
    0.02  # grow the calibration run until it lasts this long, so launch costs do not skew it
)
# keep the GPU busy this long before calibrating: an idle GPU's clocks are low and ramp up under
# load
WARM_UP_S = 0.3
MAX_UNITS = 2**31 - 16  # the spin kernel's iteration count is an int32


def measure_overlap(device: int, target_ms: float, env: Env, timeout: float) -> Finding:
    """Both workers' timings and, per kernel, the overlap ratio and verdict; "verdict" is the spin
    kernel's."""
    barrier = SPAWN.Barrier(2)
    barrier_s = timeout / 2  # covers the slower side's CUDA start and Triton compile
    children = [
        start_child(
            overlap_worker, (i, barrier, device, target_ms, barrier_s), env, name=f"overlap-{i}"
        )
        for i in range(2)
    ]
    sides = finish_all(children, timeout)
    result: Finding = {
        kernel: overlap_verdict([side.get(kernel, {}) for side in sides]) for kernel in KERNELS
    }
    spin = result["spin"]
    ok = spin["ratio"] is not None
    errors = [side["error"] for side in sides if side.get("error")]
    result.update(
        ok=ok,
        error="; ".join(errors) or (None if ok else spin["reason"]),
        verdict=spin["verdict"],
        ratio=spin["ratio"],
        target_ms=target_ms,
        sides=sides,
    )
    return result


def overlap_worker(
    index: int, barrier: Any, device: int, target_ms: float, barrier_s: float
) -> Finding:
    """One side (runs in a child): per kernel, its solo time and its start/end when launched with
    the other side."""
    import torch

    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    found: Finding = {
        "pid": os.getpid(),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
        "mps_enabled": mps_enabled(device),
    }
    for kernel in KERNELS:
        found[kernel] = _run_together(index, barrier, kernel, device, target_ms, barrier_s)
    return found


def _run_together(
    index: int, barrier: Any, kernel: str, device: int, target_ms: float, barrier_s: float
) -> Finding:
    import torch

    side: Finding = {"ok": False, "error": None}
    launch = None
    for turn in range(
        2
    ):  # one side at a time: neither calibrates or times its solo run against the other's load
        if turn == index:
            try:
                launch, side["solo_s"], side["units"] = _calibrate(
                    _launcher(kernel, device), target_ms
                )
            except Exception as exc:
                side["error"] = error_text(exc)
        barrier.wait(barrier_s)  # a failed side still takes part, so the other is not left waiting
    barrier.wait(barrier_s)
    if launch is None:
        return side
    start = time.monotonic()
    launch()
    torch.cuda.synchronize()
    side.update(ok=True, start=start, end=time.monotonic())
    return side


def _launcher(kernel: str, device: int) -> Callable[[int], None]:
    """launch(units): enqueue one kernel doing units of work (spin iterations, or clock cycles to
    sleep)."""
    import torch

    if kernel == "sleep":
        return lambda units: torch.cuda._sleep(units)
    from partition.probe_kernels import BLOCK, spin

    out = torch.empty(
        4 * BLOCK, device=device, dtype=torch.float32
    )  # four thread blocks: a few SMs, not the GPU
    return lambda units: spin(out, units)


def _calibrate(
    launch: Callable[[int], None], target_ms: float
) -> tuple[Callable[[], None], float, int]:
    """(a launch of about target_ms, its measured solo time, its units)."""
    units = 1 << 16
    _timed(lambda: launch(units))  # compiles and warms up
    elapsed = _timed(lambda: launch(units))
    while elapsed < MIN_CALIBRATION_S:
        units *= 4
        elapsed = _timed(lambda: launch(units))
    warm_until = time.monotonic() + WARM_UP_S
    while time.monotonic() < warm_until:
        elapsed = _timed(lambda: launch(units))
    units = min(MAX_UNITS, max(16, int(units * target_ms / 1000 / elapsed) // 16 * 16))
    return (lambda: launch(units)), _timed(lambda: launch(units)), units


def _timed(run: Callable[[], None]) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.monotonic()
    run()
    torch.cuda.synchronize()
    return time.monotonic() - start
