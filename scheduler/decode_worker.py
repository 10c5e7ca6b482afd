"""The decode worker process: owns the weights, the KV pool and its blocks; decodes in continuous
batches.

Its loop is the request lifecycle of docs/design.md: take requests and prefill
notifications, schedule (admit, hand prefills off, preempt), run one step of
decodes plus inline prefill chunks, sample, stream the tokens out.

In a one-process unit (--partition green, or --prefill-worker thread) the prefill
worker is a thread of this process, with the same sockets and messages; on a GPU
each runs on its own stream (partition/green.py), and the share manager picks
the streams' split per step.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq

from engine.block_manager import BlockManager
from engine.engine import Engine, Launched, device_info
from engine.kv_events import AllBlocksCleared, BlockHasher, KVEventPublisher, offset_endpoint
from engine.kv_tier import GIB, KVCopy, TierIndex
from engine.memory_plan import StartupError
from engine.model_runner import StepInput
from engine.parallel import (
    SINGLE,
    FollowerLink,
    TensorParallel,
    follower_socket,
    init_tensor_parallel,
)
from engine.shared_memory import release_name
from partition.backends import backend_of, check_in_worker
from partition.cpu import repin
from partition.cpu_contention import CoreWatch, warn_if_busy
from partition.green import WHOLE, StreamSplits, graph_targets, on_stream
from partition.manager import ShareManager, Split
from partition.profile import PartitionProfile, ProfileError, shipped_profile
from profiles import unit_device_name
from scheduler.config import UnitConfig
from scheduler.decode_scheduler import DecodeScheduler, Step
from scheduler.messages import (
    ITERATION_TOKEN_BUCKETS,
    AbortPrefill,
    AbortRequest,
    FromPrefill,
    GenerateRequest,
    Hello,
    PrefillDone,
    PrefillReady,
    RequestOutput,
    SetShare,
    TierCounts,
    ToDecode,
    UnitSetup,
    WorkerOutput,
    WorkerReady,
)
from scheduler.prefill_worker import start_prefill_follower_thread, start_prefill_thread
from scheduler.worker_setup import (
    ApiServers,
    ema,
    init_worker_process,
    recv_nowait,
    requests_socket,
    run_or_report,
    zmq_socket,
)

STATS_INTERVAL_S = 0.25
# The inline cost fit of a mixture of experts: the weight of the newest prefill in its moving sums;
# how far from proportional (1 - the squared correlation) tokens and added experts must be over the
# recent prefills for the fit to split their costs; the inline speed reported when the experts carry
# the whole cost.
EXPERT_FIT_WEIGHT = 0.05
MIN_FIT_INDEPENDENCE = 0.01
INLINE_TOKENS_PER_S_CAP = 1e9
# Debug builds (tests set it): the scheduler and block manager prove their books whenever the worker
# goes idle.
CHECK_INVARIANTS = os.environ.get("PPD_CHECK_INVARIANTS") == "1"
THREAD_SWITCH_INTERVAL_S = (
    0.001  # a one-process unit: how long one worker's thread may hold the GIL (default 5 ms)
)
log = logging.getLogger("ppd.decode")


class StepTimes:
    """Recent step times, split into what a decode step costs and what an inline prefill adds to
    one: a cost per token and, of a mixture of experts, a cost per expert its tokens route to that
    the step's decode tokens do not (docs/policy.md#mixtures-of-experts)."""

    def __init__(self, experts: Callable[[float], float] | None = None) -> None:
        self.decode_step_ms = 0.0
        self.inline_tokens_per_s = 0.0
        # Of a mixture of experts: the experts n tokens read in all layers under uniform routing
        # (ModelConfig.expected_experts), what reading one adds to a step, and the moving sums of
        # the least-squares fit of an inline prefill's extra milliseconds y over its tokens n and
        # the experts e it adds: n*n, n*e, e*e, n*y, e*y.
        self.experts = experts
        self.expert_ms = 0.0
        self.sums = [0.0] * 5
        self.steps = 0
        self.step_seconds = 0.0  # in the engine's steps
        self.loop_seconds = 0.0  # in the worker's loop around them
        self.iteration_tokens = [0] * (
            len(ITERATION_TOKEN_BUCKETS) + 1
        )  # steps by their token count (WorkerStats)
        self.iteration_tokens_sum = 0

    def loop(self, step_s: float, iteration_s: float) -> None:
        """One turn of the worker's loop that ran a step of step_s seconds took iteration_s in
        all."""
        self.steps += 1
        self.step_seconds += step_s
        self.loop_seconds += max(0.0, iteration_s - step_s)

    def record(self, inputs: list[StepInput], seconds: float) -> None:
        tokens = sum(len(i.token_ids) for i in inputs)
        self.iteration_tokens[bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.iteration_tokens_sum += tokens
        prefill_tokens = sum(
            len(i.token_ids) for i in inputs if len(i.token_ids) > 1 or not i.sample
        )
        ms = 1000.0 * seconds
        if prefill_tokens == 0:
            self.decode_step_ms = ema(self.decode_step_ms, ms)
        elif 0.0 < self.decode_step_ms < ms:
            extra = ms - self.decode_step_ms
            if self.experts is None:
                self.inline_tokens_per_s = ema(
                    self.inline_tokens_per_s, prefill_tokens / extra * 1000
                )
            else:
                added = self.experts(tokens) - self.experts(tokens - prefill_tokens)
                self.fit_experts(prefill_tokens, added, extra)

    def fit_experts(self, tokens: int, added: float, extra_ms: float) -> None:
        """An inline prefill of `tokens` tokens that routed to `added` experts more than the step's
        decode tokens added extra_ms to the step: refit extra = tokens * ms_per_token + added *
        expert_ms over the recent ones (moving sums). Where the recent prefills cannot tell the two
        apart (one size over one batch: tokens and experts in proportion), or the fit gives one a
        negative cost, the other alone carries it."""
        for i, x in enumerate(
            (tokens * tokens, tokens * added, added * added, tokens * extra_ms, added * extra_ms)
        ):
            self.sums[i] += EXPERT_FIT_WEIGHT * (x - self.sums[i])
        nn, ne, ee, ny, ey = self.sums
        det = nn * ee - ne * ne
        per_token = per_expert = 0.0
        if det > MIN_FIT_INDEPENDENCE * nn * ee:
            per_token, per_expert = (ee * ny - ne * ey) / det, (nn * ey - ne * ny) / det
        if per_token <= 0.0 and per_expert > 0.0:
            per_token, per_expert = 0.0, ey / ee
        if per_expert <= 0.0:
            per_token, per_expert = ny / nn, 0.0
        self.expert_ms = per_expert
        self.inline_tokens_per_s = (
            1000.0 / per_token if per_token > 0.0 else INLINE_TOKENS_PER_S_CAP
        )


@dataclass
class InFlight:
    """A step launched on the device whose results the worker has not taken yet."""

    step: Step
    launched: Launched
    started: float  # perf_counter() at its launch


class DecodeWorker:
    def __init__(
        self,
        cfg: UnitConfig,
        out: ApiServers,
        ctx: zmq.Context,
        tp: TensorParallel = SINGLE,
        prefill_tp: TensorParallel = SINGLE,
    ) -> None:
        """tp: rank 0's communicator under tensor parallelism (its followers run DecodeFollower);
        prefill_tp: in a one-process unit, the prefill thread's."""
        self.cfg, self.out, self.ctx = cfg, out, ctx
        # A one-process unit on a GPU: each worker's stream per split, made before the engine, whose
        # decode graphs are captured on them.
        self.streams, self.partition_problem = unit_streams(cfg)
        self.key = WHOLE  # the split the workers run on now
        self.engine = Engine.create(
            cfg.engine,
            (cfg.shm_name("weights"), cfg.shm_name("kv")),
            *graph_targets(self.streams, "decode"),
            tp,
        )
        follower_handles = exchange_handles(self.engine, tp)
        if tp.enabled:
            self.engine.lead(FollowerLink(ctx, cfg.follower_addresses("decode")))
        plan = self.engine.plan
        self.kv_events = kv_event_publisher(cfg, ctx)
        hasher = BlockHasher(cfg.hash_algo) if self.kv_events is not None else None
        self.tp_size = tp.size
        tier = None
        if cfg.kv_offloading_gib > 0:
            store = self.engine.add_tier(cfg.kv_offloading_gib / tp.size, cfg.kv_offloading_dir)
            tier = TierIndex(store.capacity)
            log.info(
                "second KV tier: %d blocks (%.2f GiB) in %s",
                store.capacity,
                store.capacity * store.block_nbytes * tp.size / GIB,
                store.path or "pinned host memory",
            )
        # Copies between the pool and the tier queued on the device, with the event of their end.
        self.copying: list[tuple[Any, list[KVCopy]]] = []
        self.tier_tokens_per_s = 0.0  # the copies' moving-average rate (where they run in line)
        self.scheduler = DecodeScheduler(
            BlockManager(plan.num_blocks, plan.block_size, hasher, tier, cfg.kv_retention_share),
            self.engine.mcfg.eos_token_ids,
            plan.max_model_len,
            cfg.engine.max_num_seqs,
            cfg.engine.max_num_batched_tokens,
            cfg.prefill_worker == "none",
            self.engine.mcfg.vocab_size,
            cfg.prefill_batch_tokens,
        )
        self.requests = requests_socket(ctx, cfg)
        self.poller = zmq.Poller()
        self.poller.register(self.requests, zmq.POLLIN)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode_request = msgspec.msgpack.Decoder(ToDecode).decode
        self.decode_notify = msgspec.msgpack.Decoder(FromPrefill).decode
        if cfg.prefill_worker == "none":
            self._release_names()
        else:
            self.jobs = zmq_socket(ctx, zmq.PUSH, cfg.jobs_address, bind=True)
            self.notify = zmq_socket(ctx, zmq.PULL, cfg.notify_address, bind=True)
            self.poller.register(self.notify, zmq.POLLIN)
        self.pending: list[RequestOutput] = []
        self.prefill_ready: WorkerReady | None = (
            None  # what the prefill worker told the API servers (Hello)
        )
        self.recount = (
            False  # a dead API server's requests were stopped: the next output says what is left
        )
        self.shares = (
            None if cfg.prefill_worker == "none" else share_manager(cfg, self.streams, self.engine)
        )
        # On the CPU, torch's pool follows the cores other processes leave to this worker (a
        # prefill thread shares the process's pool, so only a worker of its own watches).
        self.core_watch = (
            CoreWatch(tuple(sorted(os.sched_getaffinity(0))), f"unit {cfg.unit} decode worker")
            if self.engine.device.type == "cpu" and cfg.prefill_worker != "thread"
            else None
        )
        if self.core_watch is not None and tp.rank == 0:
            warn_if_busy(self.core_watch.cores, f"unit {cfg.unit} decode worker")
        if self.streams is not None and self.shares is not None:
            self.use_split(self.shares.current)
        elif (
            self.streams is not None and self.streams.decode_counts()
        ):  # a static split: the middle one
            self.use_split(Split(tuple(range(self.streams.middle_decode_sms())), ()))
        if cfg.prefill_worker == "thread":
            sys.setswitchinterval(THREAD_SWITCH_INTERVAL_S)
            start_prefill_thread(
                cfg,
                ctx,
                self.engine,
                self.streams,
                self.key,  # before UnitSetup: PUSH waits for it
                prefill_tp,
            )
        if cfg.prefill_worker != "none":
            self.jobs.send(
                self.encode(
                    UnitSetup(
                        self.engine.weights_handle,
                        self.engine.kv_handle,
                        plan.num_blocks,
                        plan.max_model_len,
                        follower_handles,
                    )
                )
            )
        self.partition_problem = self.partition_problem or check_in_worker(
            cfg.partition, str(self.engine.device)
        )
        if self.partition_problem:
            log.error("partition %s: %s", cfg.partition.backend, self.partition_problem)
        self.times = StepTimes(mcfg.expected_experts if (mcfg := self.engine.mcfg).is_moe else None)
        # Async scheduling: the step on the device whose results are not taken yet, and the one
        # launched after it.
        self.async_scheduling = cfg.async_scheduling and not tp.enabled
        if self.async_scheduling:
            log.info("async scheduling on: each step is built while the one before runs")
        self.in_flight: InFlight | None = None
        self.latest: InFlight | None = None
        self.last_done = 0.0
        self.last_stats = self.memory_read = 0.0
        self.memory_used = 0
        info = device_info(self.engine.device)
        self.ready = WorkerReady(
            "decode", os.getpid(), info.name, info.total_memory, plan.num_blocks, plan.max_model_len
        )
        self.send(ready=self.ready)

    def run(self) -> None:
        checked = True
        again = False  # an admission waited for the tier's copies: schedule again at once
        while True:
            busy = self.scheduler.has_step_work or self.in_flight is not None or again
            if CHECK_INVARIANTS and not busy and not checked:
                self.scheduler.check()
            checked = not busy
            began = time.perf_counter()
            self.receive(block=not busy)
            if not busy:  # the wait for work is no part of the loop's cost
                began = time.perf_counter()
            # Async scheduling: the next step is built while the one before runs on the device,
            # unless it needs that one's tokens on the host first (DecodeScheduler.schedule).
            step = self.scheduler.schedule(ahead=True) if self.in_flight is not None else None
            if step is None:
                self.complete()
                step = self.scheduler.schedule()
            again = self.scheduler.blocks.awaiting_tier
            self.copy_kv(step)
            for job in step.jobs:
                self.jobs.send(self.encode(job))
            if step.started:  # before the step: it may be a prefill longer than --max-queue-time-s
                self.out.send(WorkerOutput(self.cfg.unit, started=step.started))
            if self.shares is not None:
                self.rebalance()
            if self.core_watch is not None:
                self.core_watch.check()
            engine_s = 0.0
            if step.inputs:
                engine_s = self.launch(step)
            engine_s += self.complete(keep_latest=True)
            self.flush()
            if step.inputs:
                self.times.loop(engine_s, time.perf_counter() - began)

    def launch(self, step: Step) -> float:
        """Launch step on the device behind the one in flight (async scheduling), or run it whole;
        returns the seconds spent in the engine. A launch that raises runs the step again the
        synchronous way, input by input where needed (Engine.step_each), after the step in flight is
        done."""
        started = time.perf_counter()
        if self.async_scheduling:
            previous = self.in_flight.launched if self.in_flight is not None else None
            try:
                with self.on_stream():
                    launched = self.engine.launch(step.inputs, step.sampling_seqs, previous)
            except Exception as exc:  # noqa: BLE001 - the synchronous path below sorts it out, input by input
                log.warning(
                    "launching a step of %d input(s) failed (%s: %s); running it again "
                    "synchronously",
                    len(step.inputs),
                    type(exc).__name__,
                    exc,
                )
                self.complete()
                # Not committed: scheduling again gives the same step, its tokens now on the host.
                step = self.scheduler.schedule()
                self.copy_kv(step)
            else:
                self.scheduler.commit(step)
                self.latest = InFlight(step, launched, started)
                return time.perf_counter() - started
        with self.on_stream():
            sampled, failed = self.engine.step_each(step.inputs, step.sampling_seqs)
        seconds = time.perf_counter() - started
        if not failed:
            self.times.record(step.inputs, seconds)
        self.pending += self.scheduler.postprocess(
            step, sampled.tokens, failed, sampled.logprobs, sampled.prompt_logprobs
        )
        return seconds

    def copy_kv(self, step: Step) -> None:
        """Run the copies between the pool and the second tier that scheduling recorded (evicted
        blocks stored, cached prefixes loaded) before the step and the prefill jobs that touch
        their blocks: on the CPU they are done now; on a GPU this worker's stream waits for them,
        and the prefill worker (another stream, another process) is sent its jobs only once they
        are done."""
        self.copies_done()
        copies = self.scheduler.blocks.take_copies()
        if not copies:
            return
        started = time.perf_counter()
        with self.on_stream():
            done = self.engine.copy_kv(copies)
        if done is None:
            seconds = time.perf_counter() - started
            tokens = len(copies) * self.scheduler.blocks.block_size
            self.tier_tokens_per_s = ema(self.tier_tokens_per_s, tokens / max(seconds, 1e-6))
            self.scheduler.blocks.copies_done(copies)
            return
        if step.jobs:
            done.synchronize()
        self.copying.append((done, copies))

    def copies_done(self) -> None:
        """Tell the block manager which queued copies have completed."""
        while self.copying and self.copying[0][0].query():
            self.scheduler.blocks.copies_done(self.copying.pop(0)[1])

    def complete(self, keep_latest: bool = False) -> float:
        """Take the results of the step in flight (waiting for the device) for the outputs, and free
        what the steps before held; keep_latest: the step launched last becomes the one in flight
        (else none is). Returns the seconds spent waiting."""
        waited = 0.0
        if (flight := self.in_flight) is not None:
            started = time.perf_counter()
            sampled = (
                flight.launched.result()
            )  # a device fault raises here: the unit restarts (run_or_report)
            done = time.perf_counter()
            waited = done - started
            # Its step time: from its launch, or from the end of the step before it when it was
            # queued behind one.
            self.times.record(flight.step.inputs, done - max(flight.started, self.last_done))
            self.last_done = done
            self.pending += self.scheduler.postprocess(
                flight.step, sampled.tokens, {}, sampled.logprobs, sampled.prompt_logprobs
            )
        self.in_flight, self.latest = (self.latest if keep_latest else None), None
        return waited

    def flush(self) -> None:
        """Each turn of the loop: forget the sampling state of ended requests, stream the outputs
        (and the stats, now and then), publish the KV events."""
        for request_id in self.scheduler.finished:
            self.engine.release(request_id)
        self.scheduler.finished.clear()
        self.send()
        if self.kv_events is not None and (events := self.scheduler.blocks.take_events()):
            self.kv_events.publish(events)

    def receive(self, block: bool) -> None:
        """Take every message waiting; when idle, wait for one (waking up now and then to report
        stats)."""
        events = dict(self.poller.poll(STATS_INTERVAL_S * 1000 if block else 0))
        if self.requests in events:
            while (raw := recv_nowait(self.requests)) is not None:
                self.handle_request(self.decode_request(raw))
        if self.cfg.prefill_worker != "none" and self.notify in events:
            while (raw := recv_nowait(self.notify)) is not None:
                msg = self.decode_notify(raw)
                if isinstance(msg, PrefillDone):
                    self.pending += self.scheduler.prefill_done(msg)
                elif isinstance(msg, PrefillReady):
                    self.prefill_ready = msg.ready
                    self._release_names()

    def handle_request(self, msg: ToDecode) -> None:
        if isinstance(msg, Hello):
            for ready in (self.ready, self.prefill_ready):
                if ready is not None:
                    self.out.send_to(
                        msg.api_server,
                        WorkerOutput(self.cfg.unit, stats=self.scheduler.stats(), ready=ready),
                    )
        elif isinstance(msg, GenerateRequest):
            if (error := self.scheduler.add(msg)) is not None:
                self.pending.append(error)
            else:
                self.engine.prepare(msg.request_id, msg.sampling)
        elif isinstance(msg, AbortRequest):
            self.abort(msg.request_id)
        else:
            lost = [
                request_id
                for request_id in self.scheduler.by_id
                if request_id.startswith(msg.prefix)
            ]
            for request_id in lost:
                self.abort(request_id)
            self.recount = True
            log.warning(
                "stopped the %d request(s) of an API server that died (ids %s...)",
                len(lost),
                msg.prefix,
            )

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id):
            self.jobs.send(self.encode(AbortPrefill(request_id)))

    def rebalance(self) -> None:
        """The share manager's decision for this step: repin ourselves, and tell the prefill worker
        its cores (in order with its jobs, so it takes them before its next forward pass)."""
        running = self.scheduler.running
        context = sum(len(s.token_ids) for s in running) / len(running) if running else 0.0
        split = self.shares.decide(len(running), context, self.scheduler.prefill_queue_tokens)
        if split is None:
            return
        if self.streams is not None:
            self.use_split(split)
            self.jobs.send(self.encode(SetShare([], split=self.key)))
            log.debug(
                "shares: decode %d SMs, prefill %d (%s; batch %d, context %.0f)",
                self.streams.sms("decode", self.key),
                self.streams.sms("prefill", self.key),
                self.shares.reason,
                len(running),
                context,
            )
        else:
            repin(split.decode)
            if self.core_watch is not None:
                self.core_watch.retarget(split.decode)
            self.jobs.send(self.encode(SetShare(list(split.prefill))))
            log.debug(
                "shares: decode cores %s, prefill cores %s (%s; batch %d, context %.0f)",
                split.decode,
                split.prefill,
                self.shares.reason,
                len(running),
                context,
            )

    def use_split(self, split: Split) -> None:
        """Run the next decode steps on split's decode stream (WHOLE when the split overlaps),
        replaying the graphs captured there; that stream first waits for what the old one has queued
        (a step in flight, whose tokens and KV the next step reads)."""
        key = self.streams.key_for(None if split.shared else len(split.decode))
        if key != self.key and self.in_flight is not None:
            self.streams.stream("decode", key).wait_stream(self.streams.stream("decode", self.key))
        self.key = key
        self.engine.runner.use_graphs(self.key)

    def on_stream(self) -> Any:
        """The context a step runs in: this worker's stream of the current split, in a one-process
        unit on a GPU."""
        return on_stream(self.streams, "decode", self.key)

    def send(self, ready: WorkerReady | None = None) -> None:
        """Stream this step's outputs to the API server, with the stats, at most every
        STATS_INTERVAL_S when idle."""
        now = time.monotonic()
        if (
            not self.pending
            and ready is None
            and not self.recount
            and now - self.last_stats < STATS_INTERVAL_S
        ):
            return
        self.last_stats = now
        stats = self.scheduler.stats()
        stats.decode_step_ms, stats.inline_tokens_per_s, stats.inline_expert_ms = (
            self.times.decode_step_ms,
            self.times.inline_tokens_per_s,
            self.times.expert_ms,
        )
        stats.steps, stats.step_seconds, stats.loop_seconds = (
            self.times.steps,
            self.times.step_seconds,
            self.times.loop_seconds,
        )
        if (tier := self.scheduler.blocks.tier) is not None:
            stats.tier = TierCounts(
                tier.capacity,
                tier.num_blocks,
                self.engine.tier.block_nbytes * self.tp_size,  # type: ignore[union-attr]
                self.scheduler.blocks.block_size,
                tier.stats.stored,
                tier.stats.loaded,
                tier.stats.dropped,
                self.tier_tokens_per_s,
            )
        stats.iteration_tokens = list(self.times.iteration_tokens)
        stats.iteration_tokens_sum = self.times.iteration_tokens_sum
        stats.partition_problem = self.partition_problem
        if self.streams is not None:
            stats.decode_share, stats.prefill_share = (
                self.streams.sms("decode", self.key),
                self.streams.sms("prefill", self.key),
            )
            stats.share_switches = self.shares.switches if self.shares is not None else 0
        elif self.shares is not None:
            split = self.shares.current
            stats.decode_share, stats.prefill_share = len(split.decode), len(split.prefill)
            stats.share_switches = self.shares.switches
        elif self.cfg.partition.decode.cores:
            stats.decode_share, stats.prefill_share = (
                len(self.cfg.partition.decode.cores),
                len(self.cfg.partition.prefill.cores),
            )
        if self.engine.device.type == "cuda":
            if now - self.memory_read >= STATS_INTERVAL_S:  # a driver call: not on every step
                free, total = torch.cuda.mem_get_info()
                self.memory_used, self.memory_read = total - free, now
            stats.device_memory_used = self.memory_used
        # A remote prefill that was stopped stays until the prefill worker lets its blocks go; no
        # router counts it.
        held = (
            sum(not seq.aborted for seq in self.scheduler.by_id.values()) if self.recount else None
        )
        self.out.send(WorkerOutput(self.cfg.unit, self.pending, stats, ready, held=held))
        self.pending, self.recount = [], False

    def _release_names(self) -> None:
        """Once every process has mapped the shared memory, drop its names: it then lives exactly as
        long as the workers (every tensor-parallel rank's)."""
        release_name(self.engine.weights_handle)
        release_name(self.engine.kv_handle)
        if self.engine.followers is not None:
            self.engine.followers.send("release")


def unit_streams(cfg: UnitConfig) -> tuple[StreamSplits | None, str | None]:
    """A one-process unit on a GPU: its workers' streams of each split (partition/green.py) and why
    the partition does not hold, if it does not; (None, None) elsewhere."""
    if cfg.prefill_worker != "thread" or not cfg.engine.device.startswith("cuda"):
        return None, None
    torch.zeros(1, device="cuda")  # torch's primary context is current before any driver call
    return backend_of(cfg.partition).streams(cfg.partition)


def exchange_handles(engine: Engine, tp: TensorParallel) -> list[tuple[Any, Any]]:
    """Every decode rank's shared memory, gathered on each (rank 0 sends ranks 1..N-1's to the
    prefill worker)."""
    if not tp.enabled:
        return []
    return tp.all_gather_object((engine.weights_handle, engine.kv_handle))[1:]


class DecodeFollower:
    """Decode rank 1..N-1 of a tensor-parallel unit: its device's shard of the weights and KV pool,
    the steps rank 0 runs (Engine.follow); no scheduler, socket to the API server or sampling of
    its own. In a one-process unit it starts the prefill rank of its device as a thread, over the
    same shard (prefill_tp: its communicator)."""

    def __init__(
        self,
        cfg: UnitConfig,
        ctx: zmq.Context,
        tp: TensorParallel,
        prefill_tp: TensorParallel = SINGLE,
    ) -> None:
        self.cfg = cfg
        # Bound before the engine starts: rank 0 may send its first step as soon as the pools are
        # sized.
        self.sock = follower_socket(ctx, cfg.follower_address("decode", tp.rank))
        self.streams, problem = unit_streams(cfg)
        if problem:
            log.error("partition %s: %s", cfg.partition.backend, problem)
        self.engine = Engine.create(
            cfg.engine,
            (cfg.shm_name("weights", tp.rank), cfg.shm_name("kv", tp.rank)),
            *graph_targets(self.streams, "decode"),
            tp,
        )
        exchange_handles(
            self.engine, tp
        )  # rank 0 says when every process has mapped them: "release"
        if cfg.kv_offloading_gib > 0:  # slot for slot as rank 0's: the shards are alike
            self.engine.add_tier(cfg.kv_offloading_gib / tp.size, cfg.kv_offloading_dir)
        if cfg.prefill_worker == "thread":
            sys.setswitchinterval(THREAD_SWITCH_INTERVAL_S)
            start_prefill_follower_thread(cfg, ctx, self.engine, self.streams, prefill_tp)

    def release(self) -> None:
        release_name(self.engine.weights_handle)
        release_name(self.engine.kv_handle)

    def run(self) -> None:
        self.engine.follow(
            self.sock,
            lambda kind, _: self.release() if kind == "release" else None,
            lambda key: on_stream(self.streams, "decode", key),
        )


def kv_event_publisher(cfg: UnitConfig, ctx: zmq.Context) -> KVEventPublisher | None:
    """The unit's KV-event publisher (--kv-events-config), its first event clearing what a
    subscriber knew of the unit: a restarted worker starts with an empty cache."""
    if not cfg.publishes_kv_events:
        return None
    try:
        publisher = KVEventPublisher(cfg.kv_events, cfg.unit, ctx)
    except zmq.ZMQError as exc:
        raise StartupError(
            f"--kv-events-config: unit {cfg.unit} cannot open "
            f"{offset_endpoint(cfg.kv_events.endpoint, cfg.unit)}: {exc}; is another server (or "
            "another unit's endpoint) on that port?"
        ) from exc
    publisher.publish([AllBlocksCleared()])
    log.info(
        "KV events: publishing on %s%s",
        publisher.endpoint,
        f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "",
    )
    return publisher


def share_manager(
    cfg: UnitConfig, streams: StreamSplits | None = None, engine: Engine | None = None
) -> ShareManager | None:
    """The adaptive share manager, where shares can change at run time: what the partition's backend
    says a manager may split (partition/backends.py: the cpu backend's cores, green-context splits'
    SMs)."""
    space = backend_of(cfg.partition).shares(cfg.partition, streams) if cfg.share_manager else None
    if space is None:
        return None
    what = space.what
    profile_file = cfg.partition_profile
    if profile_file is None and streams is not None and engine is not None:
        # A tensor-parallel rank's step is its shard's: only a profile made for the unit's shape
        # stands for it.
        profile_file = shipped_profile(
            unit_device_name(device_info(engine.device).name, cfg.tensor_parallel_size),
            cfg.engine.model,
        )
    profile = None
    if profile_file is not None:
        try:
            profile = PartitionProfile.load(profile_file)
        except ProfileError as exc:
            log.warning(
                "share manager: %s; an even split stands in when both workers are busy", exc
            )
    manager = ShareManager(
        space.units,
        Split(*space.start),
        profile,
        cfg.itl_slo_ms,
        sizes=space.sizes,
        free_switches=space.free_switches,
    )
    if profile is None:
        log.info(
            "share manager: no partition profile (make one with `ppd profile partition`), so the "
            "workers keep "
            "the %s they started on%s",
            what,
            ", except that a side alone gets the whole device" if manager.free_switches else "",
        )
    else:
        sizing = (
            f"decode gets the fewest {what} that keep its step within {cfg.itl_slo_ms:g} ms"
            if manager.sized_by_slo
            else "an even split when both workers are busy (no --itl-slo-ms to size decode by)"
        )
        alone = "" if manager.free_switches else " where the profile shows that pays"
        log.info(
            "share manager: %s, except that a queued prefill the whole device ends within about a "
            "decode step "
            "runs beside decode without a split; a side alone gets the whole device%s (profile %s)",
            sizing,
            alone,
            profile_file,
        )
    return manager


def run_decode_worker(cfg: UnitConfig, rank: int = 0) -> None:
    """Process entry point (rank: a tensor-parallel unit's decode rank; 1..N-1 follow rank 0)."""
    init_worker_process(cfg, "decode", rank)
    ctx = zmq.Context()
    out = ApiServers(ctx, cfg)

    def main() -> None:
        tp = init_tensor_parallel(
            cfg.tensor_parallel_size, rank, cfg.tp_store("decode"), cfg.engine.device
        )
        # A one-process unit's prefill threads: a communicator of their own over the same ranks.
        prefill_tp = tp.split() if cfg.prefill_worker == "thread" else SINGLE
        (
            DecodeWorker(cfg, out, ctx, tp, prefill_tp)
            if rank == 0
            else DecodeFollower(cfg, ctx, tp, prefill_tp)
        ).run()

    run_or_report(cfg.unit, out, main)
