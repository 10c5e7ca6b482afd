"""CoreWatch: a CPU worker's pool follows the cores other processes leave it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from partition import cpu_contention
from partition.cpu_contention import CoreTimes, CoreWatch, others_cores, threads_for


def test_the_pool_is_the_cores_others_leave() -> None:
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.4) == 2, "an API server's fraction of a core is shared, not given up"
    assert threads_for(2, 0.7) == 1
    assert threads_for(2, 1.9) == 1, "never fewer than one"
    assert threads_for(8, 3.0) == 5
    # others: the cores' busy seconds less this process's own, per second
    before, after = CoreTimes(0.0, 10.0, 3.0), CoreTimes(2.0, 13.0, 4.0)
    assert others_cores(before, after) == pytest.approx(1.0)
    assert others_cores(after, CoreTimes(2.0, 20.0, 4.0)) == 0.0, "no time passed"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_busy_loop_on_one_of_two_cores_shrinks_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    monkeypatch.setattr(cpu_contention, "PERIOD_S", 0.5)
    threads = torch.get_num_threads()
    loop = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cores[1]}}})\nwhile 1: pass"]
    )
    try:
        time.sleep(0.5)  # the loop is running
        watch = CoreWatch(cores, "test worker")
        time.sleep(0.7)
        watch.check()
        assert watch.threads == 1 and torch.get_num_threads() == 1
    finally:
        loop.kill()
        loop.wait()
        torch.set_num_threads(threads)
