"""Several API-server processes over the same units (`ppd serve --api-server-count N`), as vLLM's
flag.

One event loop tokenizes, detokenizes and streams every request; past about one core of that work,
streamed tokens wait for it (ppd bench frontend). With N > 1 the main process (API server 0: the
launcher, the units' restarts, MPS) starts N - 1 more, which listen on the same port (SO_REUSEPORT),
so the kernel spreads the connections over them evenly (a shared listening socket goes mostly to
whichever process wakes first); each one listens only once it has heard from every unit. Each has
its own EngineClient: its requests go straight to the units, and the units send its requests' tokens
straight back to it (scheduler/worker_setup.py ApiServers). What must be the same everywhere is
shared without touching a token: the routers' placements and the units' restarts over a bus through
API server 0 (engine_client.RouterBus), the request-side metrics through files (metrics.PeerStates).

An API server that dies is started again; the requests it was streaming are lost with their
connections, and API server 0 has the units stop them first (EngineClient.api_server_died). Each one
admits at most its share of --max-waiting-requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import multiprocessing as mp
import os
import signal
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess

import uvicorn

from partition.processes import process_alive
from server.engine_client import Admission, EngineClient, EngineError

log = logging.getLogger("ppd.api")

WATCH_INTERVAL_S = 0.5
PASSED_ON = {signal.SIGTERM: signal.SIGUSR1, signal.SIGINT: signal.SIGUSR2}  # see HelperServer


def admission_for(args: argparse.Namespace) -> Admission:
    """The admission limits of one API server: its share of --max-waiting-requests (rounded up)."""
    max_waiting = (
        args.max_num_seqs if args.max_waiting_requests is None else args.max_waiting_requests
    )
    share = math.ceil(max_waiting / args.api_server_count) if max_waiting else None
    return Admission(share, args.max_queue_time_s or None)


class DrainingServer(uvicorn.Server):
    """uvicorn, stopping as a server in a pool should: on SIGTERM or Ctrl-C it takes no new request
    (503), lets those in flight finish for up to shutdown_timeout, ends the rest with an error
    (streams get an error event and [DONE]), then stops. on_signal runs first (API server 0 passes
    the signal on to the others)."""

    def __init__(
        self,
        config: uvicorn.Config,
        client: EngineClient,
        shutdown_timeout: float,
        on_signal: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.client, self.shutdown_timeout, self.on_signal = client, shutdown_timeout, on_signal
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the app's lifespan

    def handle_exit(self, sig: int, frame) -> None:
        if self.on_signal is not None:
            self.on_signal(sig)
        if not self.client.draining and self.loop is not None:
            self.client.draining = True
            log.info(
                "shutting down: %d request(s) in flight get up to %gs to finish (a second Ctrl-C "
                "cuts them)",
                len(self.client.requests),
                self.shutdown_timeout,
            )
            self.loop.call_soon_threadsafe(
                self.loop.call_later, self.shutdown_timeout, self.end_the_rest
            )
        super().handle_exit(sig, frame)

    def end_the_rest(self) -> None:
        error = EngineError(
            503,
            f"the server is shutting down and this request did not finish within "
            f"--shutdown-timeout ({self.shutdown_timeout:g}s); retry",
        )
        if n := self.client.fail_all(error):
            log.warning("shutdown: ended %d request(s) that were still running", n)


def freeze_startup_heap() -> None:
    """What was loaded so far (the web stack, the tokenizer, transformers) lives as long as the
    server: kept out of the collector's generations, a collection no longer walks it while tokens
    stream."""
    gc.collect()
    gc.freeze()


class ApiServerProcesses:
    """API servers 1..N-1, started, watched and stopped by API server 0."""

    def __init__(
        self,
        args: argparse.Namespace,
        plan,
        target: Callable[[argparse.Namespace, object, int], None],
        died: Callable[[int], Awaitable[None]],
    ) -> None:
        """target(args, plan, index) is an API server's process entry point
        (server.serve.run_api_server); died(index) frees what a dead one's requests held, before it
        is started again (EngineClient.api_server_died)."""
        self.args, self.plan, self.target, self.died = args, plan, target, died
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, BaseProcess] = {}
        self.stopping = self.signalled = False

    def spawn_all(self) -> None:
        for index in range(1, self.args.api_server_count):
            self._spawn(index)

    def _spawn(self, index: int) -> None:
        proc = self.ctx.Process(
            target=self.target,
            args=(self.args, self.plan, index),
            name=f"ppd-api-{index}",
            daemon=False,
        )
        proc.start()
        self.procs[index] = proc

    async def watch(self) -> None:
        """Start again every API server that died. Run supervised (server/supervise.py) and again
        where it fails: each turn reads the processes afresh, so a new run misses no death."""
        while not self.stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for index, proc in list(self.procs.items()):
                if not self.stopping and not proc.is_alive():
                    log.error(
                        "API server %d died (exit code %s); stopping its requests in the units and "
                        "starting it "
                        "again (the streams it served are lost)",
                        index,
                        proc.exitcode,
                    )
                    await self.died(index)
                    self._spawn(index)

    def signal(self, sig: int) -> None:
        """Pass API server 0's shutdown signal on (see HelperServer): each API server drains its own
        requests."""
        self.stopping = self.signalled = True
        for proc in self.procs.values():
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, PASSED_ON[sig])

    def stop(self, timeout: float) -> None:
        """Let them drain for up to timeout (told to, unless a signal was passed on already), then
        end what is left."""
        if not self.signalled:
            self.signal(signal.SIGTERM)
        for proc in self.procs.values():
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


class HelperServer(DrainingServer):
    """API servers 1..N-1 take their shutdown signals from API server 0 only, passed on as SIGUSR1
    (for SIGTERM) and SIGUSR2 (for SIGINT): a Ctrl-C or a service manager's SIGTERM that reaches
    the whole process group would otherwise come twice, and a second Ctrl-C cuts the streams in
    flight."""

    @contextlib.contextmanager
    def capture_signals(self):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for original, passed in PASSED_ON.items():
            signal.signal(
                passed, lambda _sig, frame, original=original: self.handle_exit(original, frame)
            )
        yield


def worker_pids(client: EngineClient, unit: int) -> dict[str, tuple[int | None, bool]]:
    """role -> (pid, alive) of a unit's workers, as their ready messages gave them (API servers
    1..N-1 have no launcher)."""
    return {role: (pid, process_alive(pid)) for role, pid in client.state[unit].pids.items()}
