"""Starts the units' worker processes, watches them, and restarts a unit whose worker dies.

The two workers of a unit share memory (and on the GPU one fault reaches every
process of the device), so a unit is restarted whole: its in-flight requests end
at once with a 503, both processes go, a fresh pair comes up. A tensor-parallel
unit has a decode and a prefill process per rank, its ranks meet in collectives
that one dead rank stalls: any of them dying restarts all of them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
from multiprocessing.process import BaseProcess

from engine.shared_memory import remove_leftover
from scheduler.config import UnitConfig
from scheduler.decode_worker import run_decode_worker
from scheduler.prefill_worker import run_prefill_worker
from scheduler.stub_worker import run_stub_worker
from server.engine_client import EngineClient
from server.supervise import supervise

log = logging.getLogger("ppd.launcher")

WATCH_INTERVAL_S = 0.1
MAX_RESTART_DELAY_S = 10.0


class StartupFailed(RuntimeError):
    """A unit cannot start for a reason the operator must fix; the message says which and how."""


class Launcher:
    def __init__(self, units: list[UnitConfig], client: EngineClient) -> None:
        self.units = units
        self.client = client
        self.ctx = mp.get_context("spawn")  # fork would copy the server's threads and event loop into the workers
        self.procs: list[dict[str, BaseProcess]] = [{} for _ in units]
        self.restarts = [0] * len(units)
        self.watcher: asyncio.Task | None = None
        self.stopping = False

    def spawn_all(self) -> None:
        """Start every unit's processes; they load while the API server sets itself up."""
        for unit in range(len(self.units)):
            self._spawn(unit)

    async def start(self) -> None:
        """Watch the units (spawning them first if spawn_all was not called); returns once all are ready, or
        raises StartupFailed when a unit reports that it cannot start (the model does not fit, ...)."""
        if not any(self.procs):
            self.spawn_all()
        self.watcher = supervise("the launcher's watcher", self._watch, self.client.problems)
        await asyncio.gather(*(self.client.state[u].ready_event.wait() for u in range(len(self.units))))
        for unit, state in enumerate(self.client.state):
            if state.fatal is not None:
                self.stopping = True
                raise StartupFailed(f"unit {unit} cannot start: {state.fatal}")
        log.info("all %d unit(s) ready", len(self.units))

    def pids(self, unit: int) -> dict[str, tuple[int | None, bool]]:
        """role -> (pid, alive) of the unit's worker processes."""
        return {role: (p.pid, p.is_alive()) for role, p in self.procs[unit].items()}

    def shutdown(self) -> None:
        """Stop every worker, leaving no process and no shared-memory file behind."""
        self.stopping = True
        if self.watcher:
            self.watcher.cancel()
        for unit in range(len(self.units)):
            self._stop(unit)

    def _spawn(self, unit: int) -> None:
        cfg = self.units[unit]
        # A one-process unit's prefill worker is a thread the decode worker starts.
        one = cfg.prefill_worker != "process"
        roles = {"decode": run_decode_worker} if one else {"decode": run_decode_worker, "prefill": run_prefill_worker}
        ranks = range(cfg.tensor_parallel_size)
        if cfg.stub_step_ms is not None:
            roles, ranks = {"decode": run_stub_worker}, range(1)
        for role, target in roles.items():
            _remove(cfg.tp_store(role))  # a fresh meeting place: the last run's ranks left theirs
            for rank in ranks:
                name = role if rank == 0 else f"{role}-tp{rank}"
                args = (cfg,) if rank == 0 else (cfg, rank)
                proc = self.ctx.Process(target=target, args=args, name=f"ppd-u{unit}-{name}", daemon=True)
                proc.start()
                self.procs[unit][name] = proc

    def _stop(self, unit: int) -> None:
        # The prefill worker maps the decode worker's weights and KV pool (CUDA IPC): it is gone before the decode
        # worker, their exporter, is stopped, as freeing exported memory under an importer is undefined (under MPS,
        # a fault there would reach every client of the GPU). The same for each tensor-parallel rank's pair.
        for role in sorted(self.procs[unit], key=lambda role: role.startswith("decode")):
            p = self.procs[unit][role]
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self.procs[unit] = {}
        cfg = self.units[unit]
        for kind in ("weights", "kv"):
            for rank in range(cfg.tensor_parallel_size):
                remove_leftover(cfg.shm_name(kind, rank))

    async def _watch(self) -> None:
        """Restart every unit whose worker died. Supervised and run again where it fails (server/supervise.py): each
        turn reads the processes afresh, so a new run misses no death."""
        while not self.stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for unit, procs in enumerate(self.procs):
                if self.stopping:
                    return
                dead = [(role, p.exitcode) for role, p in procs.items() if not p.is_alive()]
                if dead:
                    await self._restart(unit, dead)

    async def _restart(self, unit: int, dead: list[tuple[str, int | None]]) -> None:
        what = ", ".join(f"{role} worker (exit code {code})" for role, code in dead)
        log.error("unit %d: %s died; failing its requests and restarting the unit", unit, what)
        self.client.reset_unit(unit, f"the worker serving this request died ({what}); the server is restarting it, retry")
        self._stop(unit)
        # Back off when a unit keeps dying at start, instead of spinning.
        delay = min(MAX_RESTART_DELAY_S, 0.5 * (2 ** self.restarts[unit]) - 0.5)
        self.restarts[unit] += 1
        if delay:
            await asyncio.sleep(delay)
        started = time.monotonic()
        self._spawn(unit)
        state = self.client.state[unit]
        while not state.ready_event.is_set():
            await asyncio.sleep(WATCH_INTERVAL_S)
            if any(not p.is_alive() for p in self.procs[unit].values()) and state.fatal is None:
                return  # died while starting: the watcher restarts it again
        if state.fatal is not None:
            log.error("unit %d cannot start again and stays down: %s", unit, state.fatal)
            self._stop(unit)  # no processes left: the watcher has nothing to restart
            return
        self.restarts[unit] = 0
        log.info("unit %d restarted in %.1fs", unit, time.monotonic() - started)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
