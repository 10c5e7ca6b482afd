"""How the launcher stops a unit's workers."""

from __future__ import annotations

import os
from types import SimpleNamespace

from server.launcher import Launcher


def test_a_unit_stops_its_prefill_worker_before_the_decode_worker_whose_memory_it_maps() -> None:
    events: list[str] = []

    class Worker:
        def __init__(self, role: str) -> None:
            self.role = role

        def is_alive(self) -> bool:
            return True

        def kill(self) -> None:
            events.append(f"kill {self.role}")

        def join(self, timeout: float | None = None) -> None:
            events.append(f"join {self.role}")

    unit = SimpleNamespace(shm_name=lambda kind, rank=0: f"ppd-test-{os.getpid()}-launcher-{kind}-{rank}",
                           tensor_parallel_size=1)
    launcher = Launcher([unit], client=None)
    launcher.procs[0] = {"decode": Worker("decode"), "prefill": Worker("prefill")}  # the order they are spawned in
    launcher._stop(0)
    assert events == ["kill prefill", "join prefill", "kill decode", "join decode"]
    assert launcher.procs[0] == {}
    # A tensor-parallel unit: every prefill rank (each maps its decode rank's shard) before any decode rank.
    events.clear()
    unit.tensor_parallel_size = 2
    launcher.procs[0] = {name: Worker(name) for name in ("decode", "decode-tp1", "prefill", "prefill-tp1")}
    launcher._stop(0)
    assert events == ["kill prefill", "join prefill", "kill prefill-tp1", "join prefill-tp1",
                      "kill decode", "join decode", "kill decode-tp1", "join decode-tp1"]
