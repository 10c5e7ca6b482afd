"""The decode worker process: owns the weights, the KV pool and its blocks; decodes in continuous batches.

Its loop is the request lifecycle of DESIGN.md: take requests and prefill
notifications, schedule (admit, hand prefills off, preempt), run one step of
decodes plus inline prefill chunks, sample, stream the tokens out.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec
import torch
import zmq

from engine.block_manager import BlockManager
from engine.engine import Engine, device_info
from engine.model_runner import StepInput
from engine.shared_memory import release_name
from partition.backends import check_in_worker
from partition.cpu import repin
from partition.manager import ShareManager, Split
from partition.profile import PartitionProfile, ProfileError
from scheduler.config import UnitConfig
from scheduler.decode_scheduler import DecodeScheduler
from scheduler.messages import (AbortPrefill, AbortRequest, FromPrefill, GenerateRequest, PrefillDone, PrefillReady,
                                RequestOutput, SetShare, ToDecode, UnitSetup, WorkerOutput, WorkerReady)
from scheduler.worker_setup import ema, init_worker_process, recv_nowait, run_or_report, zmq_socket

STATS_INTERVAL_S = 0.25
log = logging.getLogger("ppd.decode")


class StepTimes:
    """Recent step times, split into what a decode step costs and what an inline prefill token adds to one."""

    def __init__(self) -> None:
        self.decode_step_ms = 0.0
        self.inline_tokens_per_s = 0.0

    def record(self, inputs: list[StepInput], seconds: float) -> None:
        prefill_tokens = sum(len(i.token_ids) for i in inputs if len(i.token_ids) > 1 or not i.sample)
        ms = 1000.0 * seconds
        if prefill_tokens == 0:
            self.decode_step_ms = ema(self.decode_step_ms, ms)
        elif 0.0 < self.decode_step_ms < ms:
            self.inline_tokens_per_s = ema(self.inline_tokens_per_s, prefill_tokens / ((ms - self.decode_step_ms) / 1000))


class DecodeWorker:
    def __init__(self, cfg: UnitConfig, out: zmq.Socket, ctx: zmq.Context) -> None:
        self.cfg, self.out, self.ctx = cfg, out, ctx
        self.engine = Engine.create(cfg.engine, (cfg.shm_name("weights"), cfg.shm_name("kv")))
        plan = self.engine.plan
        self.scheduler = DecodeScheduler(BlockManager(plan.num_blocks, plan.block_size), self.engine.mcfg.eos_token_ids,
                                         plan.max_model_len, cfg.engine.max_num_seqs, cfg.engine.max_num_batched_tokens,
                                         cfg.aggregated, self.engine.mcfg.vocab_size)
        self.requests = zmq_socket(ctx, zmq.PULL, cfg.requests_address)
        self.poller = zmq.Poller()
        self.poller.register(self.requests, zmq.POLLIN)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode_request = msgspec.msgpack.Decoder(ToDecode).decode
        self.decode_notify = msgspec.msgpack.Decoder(FromPrefill).decode
        if cfg.aggregated:
            self._release_names()
        else:
            self.jobs = zmq_socket(ctx, zmq.PUSH, cfg.jobs_address, bind=True)
            self.notify = zmq_socket(ctx, zmq.PULL, cfg.notify_address, bind=True)
            self.poller.register(self.notify, zmq.POLLIN)
            self.jobs.send(self.encode(UnitSetup(self.engine.weights_handle, self.engine.kv_handle,
                                                 plan.num_blocks, plan.max_model_len)))
        self.pending: list[RequestOutput] = []
        self.shares = None if cfg.aggregated else share_manager(cfg)
        self.partition_problem = check_in_worker(cfg.partition, str(self.engine.device))
        if self.partition_problem:
            log.error("partition %s: %s", cfg.partition.backend, self.partition_problem)
        self.times = StepTimes()
        self.last_stats = self.memory_read = 0.0
        self.memory_used = 0
        info = device_info(self.engine.device)
        self.send(ready=WorkerReady("decode", os.getpid(), info.name, info.total_memory, plan.num_blocks,
                                    plan.max_model_len))

    def run(self) -> None:
        while True:
            self.receive(block=not self.scheduler.has_step_work)
            step = self.scheduler.schedule()
            for job in step.jobs:
                self.jobs.send(self.encode(job))
            if self.shares is not None:
                self.rebalance()
            if step.inputs:
                seqs = step.sampling_seqs
                started = time.perf_counter()
                tokens, failed = self.engine.step_each(step.inputs, [s.sampling for s in seqs], [s.num_output for s in seqs])
                if not failed:
                    self.times.record(step.inputs, time.perf_counter() - started)
                self.pending += self.scheduler.postprocess(step, tokens, failed)
            self.send()

    def receive(self, block: bool) -> None:
        """Take every message waiting; when idle, wait for one (waking up now and then to report stats)."""
        events = dict(self.poller.poll(STATS_INTERVAL_S * 1000 if block else 0))
        if self.requests in events:
            while (raw := recv_nowait(self.requests)) is not None:
                self.handle_request(self.decode_request(raw))
        if not self.cfg.aggregated and self.notify in events:
            while (raw := recv_nowait(self.notify)) is not None:
                msg = self.decode_notify(raw)
                if isinstance(msg, PrefillDone):
                    self.pending += self.scheduler.prefill_done(msg)
                elif isinstance(msg, PrefillReady):
                    self._release_names()

    def handle_request(self, msg: GenerateRequest | AbortRequest) -> None:
        if isinstance(msg, GenerateRequest):
            if (error := self.scheduler.add(msg)) is not None:
                self.pending.append(error)
        elif self.scheduler.abort(msg.request_id):
            self.jobs.send(self.encode(AbortPrefill(msg.request_id)))

    def rebalance(self) -> None:
        """The share manager's decision for this step: repin ourselves, and tell the prefill worker its cores
        (in order with its jobs, so it takes them before its next forward pass)."""
        running = self.scheduler.running
        context = sum(len(s.token_ids) for s in running) / len(running) if running else 0.0
        split = self.shares.decide(len(running), context, self.scheduler.prefill_queue_tokens)
        if split is not None:
            repin(split.decode)
            self.jobs.send(self.encode(SetShare(list(split.prefill))))
            log.debug("shares: decode cores %s, prefill cores %s (%s; batch %d, context %.0f)", split.decode,
                      split.prefill, self.shares.reason, len(running), context)

    def send(self, ready: WorkerReady | None = None) -> None:
        """Stream this step's outputs to the API server, with the stats, at most every STATS_INTERVAL_S when idle."""
        now = time.monotonic()
        if not self.pending and ready is None and now - self.last_stats < STATS_INTERVAL_S:
            return
        self.last_stats = now
        stats = self.scheduler.stats()
        stats.decode_step_ms, stats.inline_tokens_per_s = self.times.decode_step_ms, self.times.inline_tokens_per_s
        stats.partition_problem = self.partition_problem
        if self.shares is not None:
            split = self.shares.current
            stats.decode_share, stats.prefill_share = len(split.decode), len(split.prefill)
            stats.share_switches = self.shares.switches
        elif self.cfg.partition.decode.cores:
            stats.decode_share, stats.prefill_share = (len(self.cfg.partition.decode.cores),
                                                       len(self.cfg.partition.prefill.cores))
        if self.engine.device.type == "cuda":
            if now - self.memory_read >= STATS_INTERVAL_S:  # a driver call: not on every step
                free, total = torch.cuda.mem_get_info()
                self.memory_used, self.memory_read = total - free, now
            stats.device_memory_used = self.memory_used
        self.out.send(self.encode(WorkerOutput(self.cfg.unit, self.pending, stats, ready)))
        self.pending = []

    def _release_names(self) -> None:
        """Once every process has mapped the shared memory, drop its names: it then lives exactly as long as the workers."""
        release_name(self.engine.weights_handle)
        release_name(self.engine.kv_handle)


def share_manager(cfg: UnitConfig) -> ShareManager | None:
    """The adaptive share manager, where shares can change at run time (the cpu backend, two cores or more)."""
    part = cfg.partition
    if not part.runtime_shares or not cfg.share_manager:
        return None
    profile = None
    if cfg.partition_profile is not None:
        try:
            profile = PartitionProfile.load(cfg.partition_profile)
        except ProfileError as exc:
            log.warning("share manager: %s; an even split stands in when both workers are busy", exc)
    manager = ShareManager(part.cores, Split(part.decode.cores, part.prefill.cores), profile, cfg.itl_slo_ms)
    if profile is None:
        log.info("share manager: no partition profile (make one with `ppd profile partition`), so the workers keep "
                 "the cores they started on")
    elif manager.sized_by_slo:
        log.info("share manager: decode gets the fewest cores that keep its step within %g ms (profile %s); a side "
                 "alone gets every core where the profile shows that pays", cfg.itl_slo_ms, cfg.partition_profile)
    else:
        log.info("share manager: an even split when both workers are busy (no --itl-slo-ms to size decode by); a "
                 "side alone gets every core where the profile %s shows that pays", cfg.partition_profile)
    return manager


def run_decode_worker(cfg: UnitConfig) -> None:
    """Process entry point."""
    init_worker_process(cfg, "decode")
    ctx = zmq.Context()
    out = zmq_socket(ctx, zmq.PUSH, cfg.outputs_address)
    run_or_report(cfg.unit, out, lambda: DecodeWorker(cfg, out, ctx).run())
