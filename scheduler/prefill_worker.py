"""The prefill worker process: computes prompts into KV blocks the decode worker allocated.

It maps the decode worker's weights and KV pool (no copy), never allocates a
block, reads a cached prefix in place, samples the first token, sends it to the
API server and only then tells the decode worker, whose next step may read the
blocks. Jobs are packed FCFS into forward passes of at most
max_num_batched_tokens tokens; a long prompt is split into chunks.

In a one-process unit it is a thread of the decode worker's process instead
(start_prefill_thread): the same sockets and messages, the owner's engine shared
rather than mapped, and on a GPU its own stream of the split the decode worker
chose (SetShare.split), switched between two forward passes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from engine.engine import Engine, Launched, device_info
from engine.model_runner import StepInput
from engine.parallel import (
    SINGLE,
    FollowerLink,
    TensorParallel,
    follower_socket,
    init_tensor_parallel,
    receive,
)
from engine.sampler import Sampled
from engine.sampling_params import TokenLogprobs
from partition.cpu import repin
from partition.green import WHOLE, StreamSplits, graph_targets, on_stream
from scheduler.config import UnitConfig
from scheduler.messages import (
    AbortPrefill,
    PrefillDone,
    PrefillJob,
    PrefillReady,
    PrefillStats,
    RequestOutput,
    SetShare,
    ToPrefill,
    UnitSetup,
    WorkerOutput,
    WorkerReady,
)
from scheduler.sequence import SeqState, Sequence, pack
from scheduler.worker_setup import (
    ApiServers,
    ema,
    init_worker_process,
    recv_nowait,
    run_or_report,
    set_thread_name,
    worker_title,
    zmq_socket,
)

log = logging.getLogger("ppd.prefill")


@dataclass
class InFlight:
    """A pass launched on the device whose results the worker has not taken yet."""

    inputs: list[StepInput]
    active: list[Sequence]
    launched: Launched
    started: float  # perf_counter() at its launch


class PrefillWorker:
    def __init__(
        self,
        cfg: UnitConfig,
        out: ApiServers,
        ctx: zmq.Context,
        owner: Engine | None = None,
        streams: StreamSplits | None = None,
        key: int = WHOLE,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """owner: the decode worker's engine, when this worker is a thread of its process; streams
        and key: the stream splits there (a GPU) and the split to start on; tp: rank 0's
        communicator under tensor parallelism (ranks 1..N-1 follow it in run_prefill_worker, each
        over its decode rank's shard)."""
        self.cfg, self.out, self.streams, self.key = cfg, out, streams, key
        self.jobs = zmq_socket(ctx, zmq.PULL, cfg.jobs_address)
        self.notify = zmq_socket(ctx, zmq.PUSH, cfg.notify_address)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode_job = msgspec.msgpack.Decoder(ToPrefill).decode
        setup = self.decode_job(self.jobs.recv())
        assert isinstance(setup, UnitSetup), f"expected UnitSetup first, got {type(setup).__name__}"
        link = FollowerLink(ctx, cfg.follower_addresses("prefill")) if tp.enabled else None
        if owner is not None:
            self.engine = Engine.sibling(owner, *graph_targets(streams, "prefill"), tp)
            self.engine.runner.use_graphs(self.key)
        else:
            if link is not None:
                link.send_each(
                    "setup",
                    [
                        (weights, kv, setup.num_kv_blocks, setup.max_model_len)
                        for weights, kv in setup.followers
                    ],
                )
            self.engine = Engine.attach(
                cfg.engine,
                setup.weights,
                setup.kv_pool,
                setup.num_kv_blocks,
                setup.max_model_len,
                tp,
            )
        if link is not None:
            self.engine.lead(link)
        self.queue: deque[Sequence] = deque()
        self.tokens_per_s = 0.0
        self.async_scheduling = cfg.async_scheduling and not tp.enabled
        self.in_flight: InFlight | None = (
            None  # async scheduling: the pass on the device whose results are not in
        )
        self.last_done = 0.0
        info = device_info(self.engine.device)
        ready = WorkerReady("prefill", os.getpid(), info.name, info.total_memory)
        self.notify.send(self.encode(PrefillReady(os.getpid(), ready)))
        self.out.send(WorkerOutput(cfg.unit, ready=ready))

    def run(self) -> None:
        while True:
            self.receive(block=not self.queue and self.in_flight is None)
            inputs, active, first = self.pack()
            launched = None
            if inputs:
                if first:  # before the pass: it may be a prefill longer than --max-queue-time-s
                    self.out.send(WorkerOutput(self.cfg.unit, started=first))
                launched = self.launch(inputs, active)
            # Async scheduling: the step before ends here, after this one was queued behind it on
            # the device.
            self.complete()
            self.in_flight = launched

    def launch(self, inputs: list[StepInput], active: list[Sequence]) -> InFlight | None:
        """Queue a forward pass behind the one in flight (async scheduling; returns it), or run it
        whole (None). A launch that raises runs the pass again the synchronous way, after the one in
        flight."""
        done = [a for a, i in zip(active, inputs) if i.sample]
        started = time.perf_counter()
        if self.async_scheduling:
            try:
                with self.on_stream():
                    launched = self.engine.launch(inputs, done)
            except Exception as exc:  # noqa: BLE001 - the synchronous path below sorts it out, input by input
                log.warning(
                    "launching a pass of %d input(s) failed (%s: %s); running it again "
                    "synchronously",
                    len(inputs),
                    type(exc).__name__,
                    exc,
                )
                self.complete()
                self.in_flight = None
            else:
                for a, i in zip(active, inputs):
                    a.num_computed += len(i.token_ids)
                return InFlight(inputs, active, launched, started)
        # The sampled ids come back to the host only after the whole step ran: the KV is then on the
        # device, and the decode worker may read it once notified (Engine.step waits even when
        # nothing samples).
        with self.on_stream():
            sampled, failed = self.engine.step_each(inputs, done)
        for a, i in zip(active, inputs):
            a.num_computed += len(i.token_ids)
        self.took(inputs, active, sampled, failed, started)
        return None

    def complete(self) -> None:
        """Take the results of the pass in flight, once the device ran it: first tokens out, blocks
        handed back."""
        if (flight := self.in_flight) is None:
            return
        self.in_flight = None
        sampled = (
            flight.launched.result()
        )  # a device fault raises here: the unit restarts (run_or_report)
        self.took(flight.inputs, flight.active, sampled, {}, flight.started)

    def took(
        self,
        inputs: list[StepInput],
        active: list[Sequence],
        sampled: Sampled,
        failed: dict[int, str],
        started: float,
    ) -> None:
        """A pass's results, its KV on the device: prompt logprobs kept, the measured speed, failed
        jobs ended, first tokens sent; jobs aborted while it ran handed back now."""
        done_at = time.perf_counter()
        for pos, logprobs in sampled.prompt_logprobs.items():
            active[pos].prompt_logprobs += logprobs
        if not failed:
            seconds = done_at - max(started, self.last_done)
            self.tokens_per_s = ema(
                self.tokens_per_s, sum(len(i.token_ids) for i in inputs) / seconds
            )
        self.last_done = done_at
        for pos, error in failed.items():
            # Only this job ends; its blocks go back when the decode worker reads the PrefillDone.
            if active[pos] in self.queue:
                self.drop(active[pos])
            self.notify.send(
                self.encode(
                    PrefillDone(
                        active[pos].request_id,
                        None,
                        f"the prefill worker failed on this request ({error})",
                        getattr(error, "status", 500),
                    )
                )
            )
        done = [a for a, i in zip(active, inputs) if i.sample]
        self.finish(
            [
                (a, t, lp)
                for a, t, lp in zip(done, sampled.tokens, sampled.logprobs)
                if t is not None and not a.state.finished
            ]
        )
        for a in active:
            if (
                a.state is SeqState.FINISHED_ABORTED
            ):  # its abort came while the pass ran: its blocks are written now
                self.notify.send(self.encode(PrefillDone(a.request_id, None)))

    def receive(self, block: bool) -> None:
        if block:
            self.handle(self.decode_job(self.jobs.recv()))
        while (raw := recv_nowait(self.jobs)) is not None:
            self.handle(self.decode_job(raw))

    def handle(self, msg: ToPrefill) -> None:
        if isinstance(msg, PrefillJob):
            self.queue.append(
                Sequence(
                    msg.request_id,
                    msg.token_ids,
                    msg.num_prompt,
                    msg.sampling,
                    block_table=np.asarray(msg.block_table, np.int32),
                    num_computed=msg.num_cached,
                    num_cached=msg.num_cached,
                )
            )
            self.engine.prepare(msg.request_id, msg.sampling)
        elif isinstance(msg, SetShare):
            # Between two forward passes: the next one runs on the new cores, or the new split's
            # stream (which waits for the pass in flight: a job's next chunk reads the KV of its
            # last).
            if msg.split is not None:
                if msg.split != self.key and self.in_flight is not None:
                    self.streams.stream("prefill", msg.split).wait_stream(
                        self.streams.stream("prefill", self.key)
                    )
                self.key = msg.split
                self.engine.runner.use_graphs(self.key)
            else:
                repin(tuple(msg.cores))
        elif isinstance(msg, AbortPrefill):
            for job in self.queue:
                if job.request_id == msg.request_id:
                    self.drop(job)
                    if self.in_flight is not None and job in self.in_flight.active:
                        job.state = (
                            SeqState.FINISHED_ABORTED
                        )  # handed back once the pass in flight is done (took)
                    else:
                        self.notify.send(self.encode(PrefillDone(msg.request_id, None)))
                    return

    def on_stream(self) -> Any:
        return on_stream(self.streams, "prefill", self.key)

    def pack(self) -> tuple[list[StepInput], list[Sequence], list[str]]:
        """The next forward pass: chunks of queued jobs, oldest first, up to the token budget; and
        the jobs whose first chunk it is."""
        # A job whose last chunk is in flight has nothing left to pack: it leaves the queue when
        # that pass is done.
        waiting = (job for job in self.queue if job.num_uncomputed)
        packed = pack(waiting, self.cfg.engine.max_num_batched_tokens, lambda job: job.block_table)
        return packed.inputs, packed.seqs, packed.started

    def drop(self, job: Sequence) -> None:
        """Take a job off the queue and forget what sampling kept of it."""
        self.queue.remove(job)
        self.engine.release(job.request_id)

    def finish(self, done: list[tuple[Sequence, int, TokenLogprobs | None]]) -> None:
        """First tokens to the API server (with the measured speed, which the router reads), then
        the notifications that hand the blocks back to the decode worker."""
        outputs = [
            RequestOutput(
                a.request_id,
                a.num_output,
                [t],
                route="prefill",
                num_cached_tokens=a.num_cached,
                logprobs=None if lp is None else [lp],
                prompt_logprobs=None if a.prompt_logprobs_asked is None else a.prompt_logprobs,
            )
            for a, t, lp in done
        ]
        self.out.send(
            WorkerOutput(self.cfg.unit, outputs, prefill_stats=PrefillStats(self.tokens_per_s))
        )
        for a, t, _ in done:
            self.drop(a)
            self.notify.send(self.encode(PrefillDone(a.request_id, t)))


def run_prefill_worker(cfg: UnitConfig, rank: int = 0) -> None:
    """Process entry point (rank: a tensor-parallel unit's prefill rank; 1..N-1 follow rank 0)."""
    init_worker_process(cfg, "prefill", rank)
    if cfg.gpu is not None:
        # Make this process's CUDA context now, while the decode worker loads the weights: its
        # memory measurement then sees the context as in use.
        torch.zeros(1, device="cuda")
    ctx = zmq.Context()
    out = ApiServers(ctx, cfg)

    def main() -> None:
        tp = init_tensor_parallel(
            cfg.tensor_parallel_size, rank, cfg.tp_store("prefill"), cfg.engine.device
        )
        if rank == 0:
            PrefillWorker(cfg, out, ctx, tp=tp).run()
            return
        # A follower: its decode rank's shard, from the handles rank 0 passes on, then rank 0's
        # steps.
        sock = follower_socket(ctx, cfg.follower_address("prefill", rank))
        kind, (weights, kv, num_blocks, max_model_len) = receive(sock)
        assert kind == "setup", f"expected the unit's setup first, got {kind}"
        Engine.attach(cfg.engine, weights, kv, num_blocks, max_model_len, tp).follow(sock)

    run_or_report(cfg.unit, out, main)


def start_prefill_thread(
    cfg: UnitConfig,
    ctx: zmq.Context,
    owner: Engine,
    streams: StreamSplits | None,
    key: int,
    tp: TensorParallel = SINGLE,
) -> threading.Thread:
    """The prefill worker as a thread of the decode worker's process (tp: its communicator, a
    tensor-parallel unit's prefill rank 0). It ends only with the process: if it fails, the process
    exits, and the launcher restarts the unit as it does when a worker process dies."""

    def main() -> None:
        out = ApiServers(ctx, cfg)
        run_or_report(
            cfg.unit, out, lambda: PrefillWorker(cfg, out, ctx, owner, streams, key, tp).run()
        )

    return _thread_of_the_unit(cfg, main, tp.rank)


def start_prefill_follower_thread(
    cfg: UnitConfig,
    ctx: zmq.Context,
    owner: Engine,
    streams: StreamSplits | None,
    tp: TensorParallel,
) -> threading.Thread:
    """Prefill rank 1..N-1 of a one-process tensor-parallel unit: a thread of its decode rank's
    process over the same shard, running the steps prefill rank 0 sends."""

    def main() -> None:
        sock = follower_socket(ctx, cfg.follower_address("prefill", tp.rank))
        engine = Engine.sibling(owner, *graph_targets(streams, "prefill"), tp)
        engine.follow(sock, on_stream=lambda key: on_stream(streams, "prefill", key))

    return _thread_of_the_unit(cfg, main, tp.rank)


def _thread_of_the_unit(cfg: UnitConfig, main: Any, rank: int = 0) -> threading.Thread:
    """A thread that ends only with its process: when main fails or returns, the process exits (code
    3: a start-up error run_or_report told the API server of), and the launcher restarts the
    unit. It is named as the prefill worker's process would be (ppd::u0-prefill)."""

    def run() -> None:
        torch.set_grad_enabled(False)  # per thread
        set_thread_name(worker_title(cfg, "prefill", rank))
        code = 1
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            log.exception("the prefill thread failed; the unit restarts")
        os._exit(code)

    thread = threading.Thread(target=run, name=f"ppd-u{cfg.unit}-prefill", daemon=True)
    thread.start()
    return thread
