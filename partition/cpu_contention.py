"""A CPU worker's threads against other processes on its cores.

A step on the CPU is hundreds of parallel regions (each matmul, norm and attention call), each
ending at a barrier that waits for every thread of torch's pool. When another process takes one of
the worker's cores, the thread on that core runs only in the scheduler's time slices
(milliseconds), and every barrier waits for it: a token that took 4 ms alone took 30-160 ms beside
a one-core busy loop (issue 50). A pool as large as the cores left to the worker has no thread to
wait for: the cost of a busy core is then in proportion to the core lost.

CoreWatch measures, over about a second at a time, how much of the worker's cores other processes
used (the cores' busy and stolen time in /proc/stat, less this process's own CPU time) and sizes
torch's pool (which the CPU kernels follow: they take torch.get_num_threads()) to the cores left.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("ppd.partition")

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PERIOD_S = 1.0  # how often the share is measured (its resolution is a tick, 1/HZ s, a core)
# A core counts as taken when others used this much of it: an API server streaming beside the
# worker takes a fraction of a core, which the worker's threads share without waiting long.
TAKEN = 0.6


@dataclass(frozen=True)
class CoreTimes:
    """The cores' busy and stolen seconds, and this process's CPU seconds, at one moment."""

    at: float
    busy_s: float
    own_s: float


def read_times(cores: tuple[int, ...]) -> CoreTimes | None:
    """The cores' time so far; None where /proc/stat does not say (not Linux)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cores}
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            # user nice system idle iowait irq softirq steal ...: all but idle and iowait
            values = [int(v) for v in rest.split()[:8]]
            ticks += sum(values) - values[3] - values[4]
    own = os.times()
    return CoreTimes(time.monotonic(), ticks / HZ, own.user + own.system)


def others_cores(before: CoreTimes, after: CoreTimes) -> float:
    """How many of the cores other processes (and the hypervisor) used between two readings."""
    elapsed = after.at - before.at
    if elapsed <= 0:
        return 0.0
    return max(0.0, (after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / elapsed


def threads_for(cores: int, others: float) -> int:
    """The pool size for `cores` cores of which others use `others`: one thread per core they
    leave (a core counts as taken from TAKEN of it on), at least one."""
    taken = int(others + (1 - TAKEN))
    return max(1, min(cores, cores - taken))


class CoreWatch:
    """Keeps torch's pool as large as the worker's cores that other processes leave to it (call
    `check` between steps: it reads /proc/stat once a PERIOD_S)."""

    def __init__(self, cores: tuple[int, ...], role: str) -> None:
        self.cores, self.role = cores, role
        self.threads = len(cores)
        self.last = read_times(cores)
        self.shrunk_since: float | None = None

    def retarget(self, cores: tuple[int, ...]) -> None:
        """The worker was moved to other cores (CPU shares): measure those from now."""
        self.cores, self.threads = cores, len(cores)
        self.last = read_times(cores)

    def check(self) -> None:
        if self.last is None or len(self.cores) < 2 or os.environ.get("PPD_CORE_WATCH") == "0":
            return
        if time.monotonic() - self.last.at < PERIOD_S:
            return
        now = read_times(self.cores)
        if now is None:
            return
        others, self.last = others_cores(self.last, now), now
        threads = threads_for(len(self.cores), others)
        if threads == self.threads:
            return
        if threads < self.threads:
            log.warning(
                "%s: other processes use %.1f of its %d cores (%s): running %d thread(s) on the "
                "rest until they stop, instead of waiting on the busy ones at every barrier",
                self.role,
                others,
                len(self.cores),
                ",".join(map(str, self.cores)),
                threads,
            )
        else:
            log.info(
                "%s: its cores are free again (others use %.1f): %d threads",
                self.role,
                others,
                threads,
            )
        self.threads = threads
        torch.set_num_threads(threads)


def warn_if_busy(cores: tuple[int, ...], role: str, sample_s: float = 0.5) -> threading.Thread:
    """At start, on a thread of its own (the start does not wait): warn when other processes
    already use a core's worth or more of cores over sample_s (the worker's CoreWatch then runs
    fewer threads once it steps)."""

    def sample() -> None:
        before = read_times(cores)
        time.sleep(sample_s)
        after = read_times(cores)
        if before is None or after is None:
            return
        others = others_cores(before, after)
        if others >= TAKEN:
            log.warning(
                "%s: its cores %s are already %.0f%% busy with other processes (%.1f of %d "
                "cores): its steps will be slower while they are; it runs on the cores they "
                "leave",
                role,
                ",".join(map(str, cores)),
                100 * others / len(cores),
                others,
                len(cores),
            )

    thread = threading.Thread(target=sample, name="core-check", daemon=True)
    thread.start()
    return thread
