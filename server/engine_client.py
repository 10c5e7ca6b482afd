"""The API server's side of the units: sends requests, streams their tokens back, tracks unit
health.

Lives in the main process, talks to workers only by messages. A request's
tokens may arrive from two workers (the prefill worker sends the first one), so
outputs are put back in order by their index before a caller sees them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams, TokenLogprobs
from scheduler.config import UnitConfig
from scheduler.messages import (
    AbortPrefix,
    AbortRequest,
    GenerateRequest,
    Hello,
    RequestOutput,
    Route,
    RouterEvent,
    UnitReset,
    WorkerOutput,
    WorkerReady,
    WorkerStats,
    new_request_id,
    request_prefix,
)
from server.metrics import SNAPSHOT_INTERVAL_S, Metrics
from server.routing.policy import Outcome
from server.routing.router import Placement, Router
from server.supervise import supervise

log = logging.getLogger("ppd.api")


class EngineError(Exception):
    """A request could not be completed; status is the HTTP status to answer with (retry_after:
    seconds, for 429)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class Admission:
    """Bounded waiting per unit: a request that cannot start soon is answered 429 at once, not
    queued for minutes.

    A request waits from its arrival until a worker puts its first chunk in a step (the worker says
    so before the step runs; a first token says so too). A unit takes a new one while fewer than
    max_waiting of its requests wait and the wait it predicts is within max_queue_s: its waiting
    requests times the mean time between two starts while requests were queued (measured only under
    a backlog, so an idle spell does not read as a slow unit); a request that has waited max_queue_s
    all the same (a burst, a slow step) is ended with 429, and its blocks freed. Once started, a
    request runs to its end however long its prefill takes: the limit bounds queueing, not work.
    """

    max_waiting: int | None = None  # None: no limit
    max_queue_s: float | None = None


START_INTERVAL_SAMPLES = 16  # the latest backlog samples the time between starts is the median of
START_INTERVAL_MIN_SAMPLES = (
    4  # samples before the median predicts a wait (and so refuses a request)
)
MAX_RETRY_AFTER_S = 60
READER = "the output reader"  # the background tasks' names, in the log and on /health
BUS = "the router bus"
UNIT_SEND_TIMEOUT_S = (
    1.0  # a message outside a request's path that a unit does not take by then is dropped
)
DROPPED_LOG_EVERY = 1000  # router events: one warning per this many dropped


@dataclass
class StartRate:
    """The time between two starts (a request's first chunk put in a step) on a unit while requests
    were queued: the median of the latest samples.

    Starts come in batches: every request a worker started in one step starts at the same moment. A
    batch is one sample, its gap from the previous start shared among its requests; counting the
    first request of a batch at the whole gap and the others at zero would let the first sample
    alone say "one start per step" after a burst, and answer 429 to a queue the next step clears.

    A median, and none before START_INTERVAL_MIN_SAMPLES: one slow step (a partition's first prefill
    of a burst) must not be the estimate the rest of the burst is refused on
    (docs/reliability.md#measurements-behind-the-code).
    """

    last_start: float = 0.0
    _samples: deque[float] = field(default_factory=lambda: deque(maxlen=START_INTERVAL_SAMPLES))
    _batch_gap: float | None = (
        None  # the current batch's gap from the previous one (None: not a backlog sample)
    )
    _batch_size: int = 0

    @property
    def interval_s(self) -> float | None:
        """The time between starts, or None while too few samples were taken to say."""
        return (
            statistics.median(self._samples)
            if len(self._samples) >= START_INTERVAL_MIN_SAMPLES
            else None
        )

    def started(self, now: float, arrival: float) -> None:
        """A request that arrived at `arrival` started at `now`."""
        if now != self.last_start:  # a new batch: the previous one's sample is complete
            self._fold()
            # A request already queued at the previous start: the gap measures the unit, not the
            # arrivals.
            self._batch_gap = (
                now - self.last_start
                if 0.0 < self.last_start and arrival <= self.last_start
                else None
            )
            self._batch_size = 0
            self.last_start = now
        self._batch_size += 1

    def _fold(self) -> None:
        if self._batch_gap is not None and self._batch_size:
            self._samples.append(self._batch_gap / self._batch_size)
        self._batch_gap = None


@dataclass
class Delta:
    """New tokens of one request, in order. route and num_cached_tokens are set on the first
    delta."""

    token_ids: list[int]
    finish_reason: str | None = None
    route: Route | None = None
    num_cached_tokens: int | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = (
        None  # on the first delta, when the request asked for them
    )


def coalesce(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one."""
    first = deltas[0]
    logprobs = None if first.logprobs is None else [lp for d in deltas for lp in d.logprobs or []]
    prompt_logprobs = next(
        (d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None
    )
    route = next((d for d in deltas if d.route is not None), None)
    return Delta(
        [t for d in deltas for t in d.token_ids],
        deltas[-1].finish_reason,
        route.route if route else None,
        route.num_cached_tokens if route else None,
        logprobs,
        prompt_logprobs,
    )


@dataclass
class _Request:
    request_id: str
    unit: int
    placement: Placement
    prompt_ids: list[int]
    pending: list[Delta | EngineError] = field(
        default_factory=list
    )  # delivered, not yet taken by the caller
    waiter: asyncio.Future | None = None  # set while the caller waits for pending to fill
    next_index: int = 0
    early: dict[int, RequestOutput] = field(
        default_factory=dict
    )  # outputs that arrived before their predecessors
    output_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float = 0.0
    last_token: float = 0.0
    started_at: float | None = (
        None  # when a worker put its first chunk in a step (None: it waits still)
    )
    route: Route | None = None  # where the unit ran the prefill (with the cached length it found)
    cached: int | None = None
    done: bool = False
    abort: bool = False  # ended here while its unit still runs it: the unit must be told to stop it

    @property
    def started(self) -> bool:
        """A worker put its first chunk in a step: it waits no more."""
        return self.started_at is not None

    def put(self, item: Delta | EngineError) -> None:
        self.pending.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self, timeout: float | None) -> list[Delta | EngineError]:
        """Everything delivered since the last take, waiting for something first (TimeoutError after
        timeout s). A list and one future instead of an asyncio.Queue: a token costs an append, and
        a wake-up only when the caller is already waiting."""
        if not self.pending:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await (self.waiter if timeout is None else asyncio.wait_for(self.waiter, timeout))
            finally:
                self.waiter = None
        items, self.pending = self.pending, []
        return items


@dataclass
class UnitState:
    ready_roles: set[str] = field(default_factory=set)
    pids: dict[str, int] = field(
        default_factory=dict
    )  # role -> the worker's pid, from its ready message
    waiting: int = (
        0  # requests sent to the unit that have not started (no chunk of theirs in a step yet)
    )
    starts: StartRate = field(default_factory=StartRate)
    stats: WorkerStats | None = None
    ready_event: asyncio.Event = field(
        default_factory=asyncio.Event
    )  # set when ready, or when it cannot start
    fatal: str | None = None  # why the unit cannot start
    device_name: str | None = None
    device_memory_total: int = 0
    num_kv_blocks: int | None = None
    max_model_len: int | None = None


class EngineClient:
    def __init__(
        self,
        units: list[UnitConfig],
        router: Router,
        metrics: Metrics,
        admission: Admission = Admission(),
        api_server: int = 0,
    ) -> None:
        """api_server: this process's index among the API servers (--api-server-count); 0 runs the
        launcher."""
        self.units = units
        self.router = router
        self.metrics = metrics
        # Clients' cache retention hints are applied (--kv-retention-share above 0).
        self.retention_on = bool(units) and units[0].kv_retention_share > 0
        self.admission = admission
        self.api_server = api_server
        self.state = [UnitState() for _ in units]
        self.requests: dict[str, _Request] = {}
        self.ctx = zmq.asyncio.Context()
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.bind(units[0].outputs_address(api_server))
        self.to_units = []
        for cfg in units:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(cfg.requests_address(api_server))
            self.to_units.append(sock)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(WorkerOutput).decode
        self.reader: asyncio.Task | None = None
        self.bus: RouterBus | None = None
        if units[0].api_servers > 1:
            self.bus = RouterBus(self.ctx, units[0], api_server)
            router.origin, router.publish = api_server, self.bus.publish
        self._ids = itertools.count()
        self.on_ready: Callable[[], None] | None = None  # called whenever a unit becomes ready
        self.draining = False  # shutting down: no new request; those in flight may finish
        self.problems: dict[
            str, str
        ] = {}  # background task -> why it is down: the process is unhealthy meanwhile

    def start(self) -> None:
        """Start the background tasks, each supervised (server/supervise.py), each run again where
        it failed: the reader keeps nothing of its own beyond the requests it fails, and what it
        knows of the units the workers send again within STATS_INTERVAL_S; the bus's events are
        hints; the metrics writer rewrites a whole file each time and carries no request, so its
        failure leaves the process healthy. Restarting the process instead would cost every
        request it serves, and on API server 0 the units too."""
        self.reader = supervise(READER, self._read_outputs, self.problems, self._reader_failed)
        if self.api_server > 0:
            # A helper API server started again after a death: units that are up never send their
            # WorkerReady again, so it asks for them (queued until a unit's decode worker starts,
            # for a helper that starts with them).
            for sock in self.to_units:
                sock.send(self.encode(Hello(self.api_server)))
        if self.bus is not None:
            bus = self.bus
            bus.task = supervise(BUS, lambda: bus.run(self._router_event), self.problems)
            bus.metrics_task = supervise("the metrics writer", self._write_metrics, None)

    def _reader_failed(self, exc: Exception) -> None:
        """The reader died: no output reaches the requests in flight, so they end with a 500, and
        their units are told to stop them (generate sends the abort)."""
        error = EngineError(
            500,
            f"internal error: the server's output reader failed ({type(exc).__name__}); the "
            "server logged it and is restarting the reader, retry",
        )
        for req in list(self.requests.values()):
            req.abort = True
            self._end(req, error, finished=False)

    def close(self) -> None:
        for task in (self.reader, self.bus and self.bus.task, self.bus and self.bus.metrics_task):
            if task:
                task.cancel()
        self.ctx.destroy(linger=0)

    def _router_event(self, event: RouterEvent) -> None:
        if isinstance(event, UnitReset):
            self._reset(event.unit, event.message)
        else:
            self.router.apply(event)

    async def _write_metrics(self) -> None:
        while True:
            self.metrics.write_state()
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)

    # ---- units -----------------------------------------------------------------------------------

    def unit_ready(self, unit: int) -> bool:
        needed = {"decode"} if self.units[unit].prefill_worker == "none" else {"decode", "prefill"}
        return needed <= self.state[unit].ready_roles

    def max_model_len(self) -> int | None:
        """The context every ready unit can hold (GPU units size their pools themselves)."""
        lens = [s.max_model_len for s in self.state if s.max_model_len is not None]
        return min(lens) if lens else None

    def predicted_wait(self, unit: int) -> float | None:
        """Seconds a new request would wait to start on unit (None: not measured yet)."""
        state = self.state[unit]
        return None if state.starts.interval_s is None else state.waiting * state.starts.interval_s

    def overloaded(self, unit: int) -> str | None:
        """Why the unit takes no new request now (None: it does)."""
        limits, state = self.admission, self.state[unit]
        if limits.max_waiting is not None and state.waiting >= limits.max_waiting:
            return (
                f"{state.waiting} requests are waiting to start"
                f" (--max-waiting-requests {limits.max_waiting})"
            )
        wait = self.predicted_wait(unit)
        if limits.max_queue_s is not None and wait is not None and wait > limits.max_queue_s:
            return (
                f"a new request would wait about {wait:.0f}s to start"
                f" (--max-queue-time-s {limits.max_queue_s:g})"
            )
        return None

    def refusal(self) -> EngineError | None:
        """Why no new request can start now (shutting down, no unit ready, every unit overloaded),
        or None.

        Also asked by the API before it parses a request (server.guard): under overload a refusal
        then costs no JSON parsing, validation or tokenization, which would take the cores from the
        requests being served."""
        if self.draining:
            return EngineError(
                503,
                "the server is shutting down; send the request to another server, or retry once "
                "this one is back",
            )
        if READER in self.problems:
            return EngineError(503, f"{self.problems[READER]}; retry shortly")
        ready = [u for u in range(len(self.units)) if self.unit_ready(u)]
        if not ready:
            return EngineError(
                503,
                "no worker unit is ready (the server is starting or restarting one); retry shortly",
            )
        if any(self.overloaded(u) is None for u in ready):
            return None
        self.metrics.rejected("overloaded")
        return EngineError(
            429,
            f"the server is overloaded: {self.overloaded(ready[0])}; retry later",
            retry_after=self._retry_after(ready),
        )

    def _retry_after(self, units: list[int]) -> float:
        waits = [w for u in units if (w := self.predicted_wait(u)) is not None]
        return float(min(MAX_RETRY_AFTER_S, max(1, math.ceil(min(waits) if waits else 1))))

    def fail_all(self, error: EngineError) -> int:
        """End every request in flight with error (at shutdown); returns how many there were."""
        reqs = list(self.requests.values())
        for req in reqs:
            self._end(req, error, finished=False)
        return len(reqs)

    def reset_unit(self, unit: int, message: str) -> None:
        """The unit's workers are gone: end its requests with a 503 and forget its state until it is
        ready again (in every API server)."""
        self._reset(unit, message)
        if self.bus is not None:
            self.bus.publish(UnitReset(self.api_server, unit, message))

    async def api_server_died(self, index: int) -> None:
        """API server `index` died (API server 0 is told, before it starts it again): its requests
        have no one to stream to, so every unit stops them, by their ids' prefix, and frees their
        blocks; then it tells every router what it holds, its load from then on. A unit that does
        not take the message within a second is restarting, and holds none of them."""
        raw = self.encode(AbortPrefix(request_prefix(index)))
        for unit, sock in enumerate(self.to_units):
            try:
                await asyncio.wait_for(sock.send(raw), UNIT_SEND_TIMEOUT_S)
            except TimeoutError:
                log.warning(
                    "unit %d did not take the abort of API server %d's requests (it is restarting)",
                    unit,
                    index,
                )

    def _reset(self, unit: int, message: str) -> None:
        for req in [r for r in self.requests.values() if r.unit == unit]:
            self._end(req, EngineError(503, message), finished=False)
        self.state[unit] = UnitState()
        self.router.forget_unit(unit)

    # ---- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session: str | None = None,
        route_hint: Route | None = None,
        unit: int | None = None,
        retain_s: float = 0.0,
    ) -> AsyncIterator[Delta]:
        """Stream a request's tokens. Raises EngineError on failure; closing the iterator early
        aborts the request. session keeps a conversation on one unit; route_hint is a client's
        choice of route for an append-prefill; unit, an outside router's choice of unit (vLLM's
        data-parallel rank), is followed while that unit can take the request, else the router
        here chooses."""
        if (refused := self.refusal()) is not None:
            raise refused
        available = [
            u for u in range(len(self.units)) if self.unit_ready(u) and self.overloaded(u) is None
        ]
        if unit in available:
            available = [unit]
        placed = self.router.route(
            prompt_ids,
            available,
            sampling.max_tokens,
            session,
            route_hint,
            sampling.min_tokens,
            sampling.ignore_eos,
        )
        # From here the request counts in its unit's load: whatever happens next, _end gives it
        # back.
        req = _Request(
            new_request_id(self.api_server, next(self._ids), uuid.uuid4().hex[:8]),
            placed.unit,
            placed,
            prompt_ids,
        )
        self.requests[req.request_id] = req
        self.state[req.unit].waiting += 1
        try:
            self.metrics.route_decision(placed.decision.route, placed.decision.reason)
            try:
                message = self.encode(
                    GenerateRequest(
                        req.request_id, prompt_ids, sampling, placed.route, placed.hashes, retain_s
                    )
                )
            except (
                OverflowError,
                TypeError,
                msgspec.EncodeError,
            ) as exc:  # the API's checks make this unreachable
                raise EngineError(
                    400, f"the request has a value no worker can take ({exc})"
                ) from exc
            await self.to_units[req.unit].send(message)
            while True:
                timeout = None
                if not req.started and self.admission.max_queue_s is not None:
                    timeout = req.arrival + self.admission.max_queue_s - time.monotonic()
                try:
                    items = await req.take(timeout)
                except TimeoutError:
                    if (
                        req.started
                    ):  # it started while this waited: its prefill may take as long as it takes
                        continue
                    self.metrics.rejected("queue_time")
                    raise EngineError(
                        429,
                        f"the server is overloaded: this request waited "
                        f"{self.admission.max_queue_s:g}s without starting (--max-queue-time-s); "
                        "retry later",
                        retry_after=self._retry_after([req.unit]),
                    ) from None
                # What piled up while the caller was busy goes out as one delta.
                deltas = [d for d in items if isinstance(d, Delta)]
                if deltas:
                    delta = deltas[0] if len(deltas) == 1 else coalesce(deltas)
                    yield delta
                    if delta.finish_reason:
                        return
                if len(deltas) < len(items):
                    raise next(e for e in items if isinstance(e, EngineError))
        finally:
            if not req.done:
                self._end(req, None, finished=False)
                req.abort = True
            if req.abort:
                await self.to_units[req.unit].send(self.encode(AbortRequest(req.request_id)))

    # ---- outputs from the workers ----------------------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            msg = self.decode(await self.outputs.recv())
            state = self.state[msg.unit]
            if msg.fatal is not None:
                state.fatal = msg.fatal
                state.ready_event.set()
            if msg.ready is not None:
                self._worker_ready(msg.unit, msg.ready)
            if msg.stats is not None:
                self.metrics.worker_stats(msg.unit, state.stats, msg.stats)
                state.stats = msg.stats
                live = self.router.live[msg.unit]
                live.prefill_queue_tokens = msg.stats.prefill_queue_tokens
                live.decode_step_ms, live.inline_tokens_per_s, live.inline_expert_ms = (
                    msg.stats.decode_step_ms,
                    msg.stats.inline_tokens_per_s,
                    msg.stats.inline_expert_ms,
                )
                live.decode_batch = msg.stats.num_running
                if (tier := msg.stats.tier) is not None:
                    self.router.tier_capacity[msg.unit] = tier.capacity
                    live.tier_tokens_per_s = tier.tokens_per_s
            if msg.held is not None:
                self.router.recount(msg.unit, msg.held)
            if msg.prefill_stats is not None:
                self.router.live[msg.unit].prefill_tokens_per_s = msg.prefill_stats.tokens_per_s
                self.metrics.prefill_speed_measured(msg.unit, msg.prefill_stats.tokens_per_s)
            now = time.monotonic()
            for request_id in msg.started:
                if (req := self.requests.get(request_id)) is not None and not req.started:
                    self._started(req, now)
            for out in msg.outputs:
                req = self.requests.get(out.request_id)
                if req is None:
                    continue  # aborted or failed already
                if out.error is not None:
                    self._end(req, EngineError(out.error_status, out.error), finished=False)
                    continue
                req.early[out.index] = out
                while (nxt := req.early.pop(req.next_index, None)) is not None:
                    self._deliver(req, nxt, now)
                    if req.done:
                        break

    def _worker_ready(self, unit: int, ready: WorkerReady) -> None:
        state = self.state[unit]
        state.ready_roles.add(ready.role)
        state.pids[ready.role] = ready.pid
        state.device_name, state.device_memory_total = ready.device, ready.device_memory_total
        if ready.num_kv_blocks is not None:
            state.num_kv_blocks, state.max_model_len = ready.num_kv_blocks, ready.max_model_len
            engine = self.units[unit].engine
            self.metrics.cache_config(
                unit,
                engine.block_size,
                engine.dtype if engine.kv_cache_dtype == "auto" else engine.kv_cache_dtype,
                ready.num_kv_blocks,
                engine.gpu_memory_utilization if engine.device != "cpu" else None,
            )
            # The router's guess of what a unit caches cannot exceed the smallest pool.
            self.router.capacity = min(
                s.num_kv_blocks for s in self.state if s.num_kv_blocks is not None
            )
        if self.unit_ready(unit):
            state.ready_event.set()
            if self.on_ready is not None:
                self.on_ready()

    def _deliver(self, req: _Request, out: RequestOutput, now: float) -> None:
        if out.route is not None and req.route is None:
            req.route, req.cached = out.route, out.num_cached_tokens
            self.metrics.prefill_routed(out.route)
        if out.token_ids:
            if not req.output_ids:
                req.first_token = now
                if not req.started:  # a worker that does not say when it starts (the stub engine)
                    self._started(req, now)
                self.metrics.first_token(now - req.arrival)
            else:
                self.metrics.inter_token(now - req.last_token, len(out.token_ids))
            req.last_token = now
            req.output_ids += out.token_ids
        req.next_index += len(out.token_ids)
        req.put(
            Delta(
                out.token_ids,
                out.finish_reason,
                out.route,
                out.num_cached_tokens,
                out.logprobs,
                out.prompt_logprobs,
            )
        )
        if out.finish_reason:
            # vLLM's phases, on this process's clock: waiting to start, its prefill (to the first
            # token), its decode.
            phases = (
                (
                    req.started_at - req.arrival,
                    req.first_token - req.started_at,
                    req.last_token - req.first_token,
                )
                if req.output_ids
                else None
            )
            self.metrics.request_finished(
                now - req.arrival,
                len(req.prompt_ids),
                len(req.output_ids),
                out.finish_reason,
                phases,
            )
            outcome = None
            if req.output_ids:
                n = len(req.output_ids)
                cached = req.cached if req.cached is not None else req.placement.est_cached_tokens
                outcome = Outcome(
                    req.route or req.placement.route,
                    cached,
                    len(req.prompt_ids) - cached,
                    n,
                    1000 * (req.first_token - req.arrival),
                    1000 * (now - req.first_token) / (n - 1) if n > 1 else None,
                )
            self._end(req, None, finished=True, outcome=outcome)

    def _started(self, req: _Request, now: float) -> None:
        req.started_at = now
        state = self.state[req.unit]
        state.waiting -= 1
        state.starts.started(now, req.arrival)

    def _end(
        self,
        req: _Request,
        error: EngineError | None,
        finished: bool,
        outcome: Outcome | None = None,
    ) -> None:
        """Forget a request; when it finished normally its unit's router index learns the answer
        too, and with an outcome the policy and the answer-length estimate learn from it."""
        if req.done:
            return
        if not req.started:
            self.state[req.unit].waiting -= 1
        req.done = True
        self.requests.pop(req.request_id, None)
        self.router.finished(
            req.unit,
            req.prompt_ids + req.output_ids if finished else req.prompt_ids,
            req.placement,
            outcome,
        )
        if error is not None:
            req.put(error)


class RouterBus:
    """Keeps the API servers' routers (and unit resets) in step: API server 0 publishes every event,
    its own and those the others push to it; each applies the events of the others. Events cost a
    message per request, never per token.

    Events are hints: publishing one never blocks and never raises. One that finds the queue full
    (API server 0 not reading, past the socket's bound of 1,000) is dropped and counted in
    `dropped`; PUB drops silently for a subscriber that far behind. An event that cannot be read or
    applied is logged and skipped."""

    def __init__(self, ctx: zmq.asyncio.Context, cfg: UnitConfig, api_server: int) -> None:
        self.api_server = api_server
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(RouterEvent).decode
        self.task: asyncio.Task | None = None
        self.metrics_task: asyncio.Task | None = None
        self.dropped = 0
        # The sending socket is a plain one: an asyncio socket's send would park a full queue's
        # zmq.Again in a future that no one awaits, and the event would be lost unseen.
        self.out = ctx.socket(zmq.PUB if api_server == 0 else zmq.PUSH, socket_class=zmq.Socket)
        if api_server == 0:
            self.out.bind(cfg.router_bus_address)
            self.inbox = ctx.socket(zmq.PULL)  # the others' events
            self.inbox.bind(cfg.router_events_address)
        else:
            self.out.connect(cfg.router_events_address)
            self.inbox = ctx.socket(zmq.SUB)  # everyone's events, as API server 0 publishes them
            self.inbox.setsockopt(zmq.SUBSCRIBE, b"")
            self.inbox.connect(cfg.router_bus_address)
        for sock in (self.inbox, self.out):
            sock.setsockopt(zmq.LINGER, 0)

    def publish(self, event: RouterEvent) -> None:
        self._send(self.encode(event))

    def _send(self, raw: bytes) -> None:
        try:
            self.out.send(raw, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % DROPPED_LOG_EVERY == 0:
                log.warning(
                    "router bus: %d event(s) dropped so far, API server 0 is not reading them (the "
                    "other "
                    "routers' view of the units' load and prefixes is a guess until it does)",
                    self.dropped,
                )
        except zmq.ZMQError as exc:  # a closed socket at shutdown, ...: a hint lost
            self.dropped += 1
            log.warning("router bus: an event could not be sent (%s)", exc)

    async def run(self, apply: Callable[[RouterEvent], None]) -> None:
        while True:
            raw = await self.inbox.recv()
            try:
                event = self.decode(raw)
            except msgspec.DecodeError as exc:
                log.error("router bus: skipped an event that cannot be read (%s)", exc)
                continue
            if event.origin == self.api_server:
                continue  # our own, back from API server 0
            if self.api_server == 0:
                self._send(raw)
            try:
                apply(event)
            except Exception:  # noqa: BLE001 - one event that cannot be applied must not stop the others
                log.exception("router bus: applying %s failed; skipped", type(event).__name__)
