"""Starts the units' worker processes, watches them, and restarts a unit whose worker dies.

The two workers of a unit share memory (and on the GPU one fault reaches every
process of the device), so a unit is restarted whole: its in-flight requests end
at once with a 503, both processes go, a fresh pair comes up. A tensor-parallel
unit has a decode and a prefill process per rank, its ranks meet in collectives
that one dead rank stalls: any of them dying restarts all of them. Each restart
runs as a task of its own, so the watcher sees a second unit die while the first
is still loading.
"""

from __future__ import annotations

import asyncio
import functools
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


def worker_context(units: list[UnitConfig]) -> mp.context.BaseContext:
    """How the workers are started. On GPUs, spawned: each a fresh interpreter (a fork would copy
    this process's threads and event loop). On the CPU, forked by a fork server that imported the
    workers' code once (scheduler/fork_server.py): a worker then starts, and a unit restarts,
    without importing torch again. The fork server is not used on GPUs, where it has not been
    tried yet."""
    if any(unit.gpu is not None for unit in units):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["scheduler.fork_server"])
    return ctx


class Launcher:
    def __init__(self, units: list[UnitConfig], client: EngineClient) -> None:
        self.units = units
        self.client = client
        self.ctx = worker_context(units)
        self.procs: list[dict[str, BaseProcess]] = [{} for _ in units]
        self.restarts = [0] * len(units)
        self.watcher: asyncio.Task | None = None
        self.restarting: dict[
            int, asyncio.Task
        ] = {}  # unit -> its restart, which runs beside the watcher
        self.down: set[int] = set()  # units that reported they cannot start: left stopped
        self.stopping = False

    def spawn_all(self) -> None:
        """Start every unit's processes; they load while the API server sets itself up."""
        for unit in range(len(self.units)):
            self._spawn(unit)

    async def start(self) -> None:
        """Watch the units (spawning them first if spawn_all was not called); returns once all are
        ready, or raises StartupFailed when a unit reports that it cannot start (the model does not
        fit, ...)."""
        if not any(self.procs):
            self.spawn_all()
        self.watcher = supervise("the launcher's watcher", self._watch, self.client.problems)
        await asyncio.gather(
            *(self.client.state[u].ready_event.wait() for u in range(len(self.units)))
        )
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
        for task in [self.watcher, *self.restarting.values()]:
            if task is not None:
                task.cancel()
        for unit in range(len(self.units)):
            self._stop(unit)

    def _spawn(self, unit: int) -> None:
        cfg = self.units[unit]
        # A one-process unit's prefill worker is a thread the decode worker starts.
        one = cfg.prefill_worker != "process"
        roles = (
            {"decode": run_decode_worker}
            if one
            else {"decode": run_decode_worker, "prefill": run_prefill_worker}
        )
        ranks = range(cfg.tensor_parallel_size)
        if cfg.stub_step_ms is not None:
            roles, ranks = {"decode": run_stub_worker}, range(1)
        for role, target in roles.items():
            _remove(cfg.tp_store(role))  # a fresh meeting place: the last run's ranks left theirs
            for rank in ranks:
                name = role if rank == 0 else f"{role}-tp{rank}"
                args = (cfg,) if rank == 0 else (cfg, rank)
                proc = self.ctx.Process(
                    target=target, args=args, name=f"ppd-u{unit}-{name}", daemon=True
                )
                proc.start()
                self.procs[unit][name] = proc

    def _stop(self, unit: int) -> None:
        # The prefill worker maps the decode worker's weights and KV pool (CUDA IPC): it is gone
        # before the decode worker, their exporter, is stopped, as freeing exported memory under an
        # importer is undefined (under MPS, a fault there would reach every client of the GPU). The
        # same for each tensor-parallel rank's pair.
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
        """Notice every unit whose worker died, at once: fail its requests with a 503, stop what is
        left of it, and start its restart as a task of its own. Supervised and run again where it
        fails (server/supervise.py): each turn reads the processes afresh, so a new run misses no
        death."""
        while not self.stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for unit, procs in enumerate(self.procs):
                if self.stopping:
                    return
                if unit in self.restarting or unit in self.down:
                    continue
                dead = [(role, p.exitcode) for role, p in procs.items() if not p.is_alive()]
                if (
                    dead or not procs
                ):  # none: a restart that failed before it started the processes again
                    self._fail(unit, dead)
                    task = asyncio.get_running_loop().create_task(
                        self._restart(unit), name=f"restart unit {unit}"
                    )
                    self.restarting[unit] = task
                    task.add_done_callback(functools.partial(self._restart_ended, unit))

    def _fail(self, unit: int, dead: list[tuple[str, int | None]]) -> None:
        """End the unit's requests (in every API server) and stop what is left of its processes."""
        what = (
            ", ".join(f"{role} worker (exit code {code})" for role, code in dead) or "its workers"
        )
        log.error("unit %d: %s died; failing its requests and restarting the unit", unit, what)
        self.client.reset_unit(
            unit,
            f"the worker serving this request died ({what}); the server is restarting it, retry",
        )
        self._stop(unit)

    async def _restart(self, unit: int) -> None:
        """Start a failed unit again, until it is ready; one that dies while starting is failed and
        started again after a longer wait, one that reports it cannot start stays down."""
        began = time.monotonic()
        while not self.stopping:
            # Back off when a unit keeps dying at start, instead of spinning.
            delay = min(MAX_RESTART_DELAY_S, 0.5 * (2 ** self.restarts[unit]) - 0.5)
            self.restarts[unit] += 1
            if delay:
                await asyncio.sleep(delay)
            self._spawn(unit)
            state = self.client.state[unit]
            dead: list[tuple[str, int | None]] = []
            while not state.ready_event.is_set() and not dead:
                await asyncio.sleep(WATCH_INTERVAL_S)
                if state.fatal is None:
                    dead = [
                        (role, p.exitcode)
                        for role, p in self.procs[unit].items()
                        if not p.is_alive()
                    ]
            if not dead:
                break
            self._fail(unit, dead)
        state = self.client.state[unit]
        if state.fatal is not None:
            log.error("unit %d cannot start again and stays down: %s", unit, state.fatal)
            self.down.add(unit)
            self._stop(unit)
            return
        if state.ready_event.is_set():
            self.restarts[unit] = 0
            log.info("unit %d restarted in %.1fs", unit, time.monotonic() - began)

    def _restart_ended(self, unit: int, task: asyncio.Task) -> None:
        self.restarting.pop(unit, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("unit %d: restarting it failed; the watcher tries again", unit, exc_info=exc)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
