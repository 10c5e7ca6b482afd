"""How the launcher stops a unit's workers and restarts units that die."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from server.engine_client import UnitState
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

    unit = SimpleNamespace(
        shm_name=lambda kind, rank=0: f"ppd-test-{os.getpid()}-launcher-{kind}-{rank}",
        tensor_parallel_size=1,
        gpu=None,
    )
    launcher = Launcher([unit], client=None)
    launcher.procs[0] = {
        "decode": Worker("decode"),
        "prefill": Worker("prefill"),
    }  # the order they are spawned in
    launcher._stop(0)
    assert events == ["kill prefill", "join prefill", "kill decode", "join decode"]
    assert launcher.procs[0] == {}
    # A tensor-parallel unit: every prefill rank (each maps its decode rank's shard) before any
    # decode rank.
    events.clear()
    unit.tensor_parallel_size = 2
    launcher.procs[0] = {
        name: Worker(name) for name in ("decode", "decode-tp1", "prefill", "prefill-tp1")
    }
    launcher._stop(0)
    assert events == [
        "kill prefill",
        "join prefill",
        "kill prefill-tp1",
        "join prefill-tp1",
        "kill decode",
        "join decode",
        "kill decode-tp1",
        "join decode-tp1",
    ]


class FakeProcess:
    def __init__(self) -> None:
        self.alive, self.exitcode, self.pid = True, None, 1

    def is_alive(self) -> bool:
        return self.alive

    def die(self) -> None:
        self.alive, self.exitcode = False, -9

    def kill(self) -> None:
        self.die()

    def join(self, timeout: float | None = None) -> None:
        pass


class ResetRecorder:
    """The engine client's side of a restart: which units' requests were failed, and their
    readiness."""

    def __init__(self, units: int) -> None:
        self.state = [UnitState() for _ in range(units)]
        self.resets: list[int] = []
        self.problems: dict[str, str] = {}

    def reset_unit(self, unit: int, message: str) -> None:
        self.resets.append(unit)
        self.state[unit] = UnitState()


def test_a_unit_that_dies_while_another_restarts_is_failed_at_once_and_restarted_beside_it() -> (
    None
):
    """A restart waits for the unit to be ready (minutes on a GPU); a second unit that dies
    meanwhile must not wait for it: its requests fail at once and it restarts beside the first."""
    units = [
        SimpleNamespace(
            shm_name=lambda kind, rank=0, u=u: f"ppd-test-{os.getpid()}-watch{u}-{kind}-{rank}",
            tensor_parallel_size=1,
            gpu=None,
        )
        for u in range(2)
    ]
    client = ResetRecorder(2)
    launcher = Launcher(units, client)
    launcher._spawn = lambda unit: launcher.procs[unit].update(
        decode=FakeProcess()
    )  # ready only when told
    launcher.procs = [{"decode": FakeProcess()}, {"decode": FakeProcess()}]

    async def until(predicate, what: str) -> None:
        try:
            async with asyncio.timeout(5):
                while not predicate():
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None

    async def main() -> None:
        launcher.watcher = asyncio.get_running_loop().create_task(launcher._watch())
        try:
            launcher.procs[0]["decode"].die()
            await until(lambda: client.resets == [0], "unit 0's requests to fail")
            launcher.procs[1]["decode"].die()  # while unit 0 restarts
            await until(
                lambda: client.resets == [0, 1], "unit 1's requests to fail while unit 0 restarts"
            )
            await until(
                lambda: all("decode" in p and p["decode"].alive for p in launcher.procs),
                "both units to be started again",
            )
            for state in client.state:
                state.ready_event.set()
            await until(lambda: launcher.restarts == [0, 0], "both restarts to finish")
            assert client.resets == [0, 1]
        finally:
            launcher.shutdown()

    asyncio.run(main())
