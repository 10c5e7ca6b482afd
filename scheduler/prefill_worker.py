"""The prefill worker process: computes prompts into KV blocks the decode worker allocated.

It maps the decode worker's weights and KV pool (no copy), never allocates a
block, reads a cached prefix in place, samples the first token, sends it to the
API server and only then tells the decode worker, whose next step may read the
blocks. Jobs are packed FCFS into forward passes of at most
max_num_batched_tokens tokens; a long prompt is split into chunks.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import msgspec
import torch
import zmq

from engine.model_runner import ModelRunner, StepInput
from engine.sampler import Sampler
from scheduler.config import UnitConfig
from scheduler.messages import (AbortPrefill, PrefillDone, PrefillJob, PrefillReady, RequestOutput, ToPrefill, UnitSetup,
                                WorkerOutput, WorkerReady)
from scheduler.worker_setup import init_worker_process, map_unit_memory, recv_nowait, socket


@dataclass
class ActiveJob:
    job: PrefillJob
    num_computed: int  # leading tokens whose KV is in the pool (starts at the cached prefix)


class PrefillWorker:
    def __init__(self, cfg: UnitConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.jobs = socket(self.ctx, zmq.PULL, cfg.jobs_address)
        self.notify = socket(self.ctx, zmq.PUSH, cfg.notify_address)
        self.out = socket(self.ctx, zmq.PUSH, cfg.outputs_address)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(ToPrefill).decode
        setup = self.decode(self.jobs.recv())
        assert isinstance(setup, UnitSetup), f"expected UnitSetup first, got {type(setup).__name__}"
        model, mcfg, kv_pool = map_unit_memory(cfg, setup.weights, setup.kv_pool)
        self.runner = ModelRunner(model, kv_pool, cfg.block_size)
        self.sampler = Sampler(mcfg.eos_token_ids)
        self.queue: deque[ActiveJob] = deque()
        self.notify.send(self.encode(PrefillReady(os.getpid())))
        self.out.send(self.encode(WorkerOutput(cfg.unit, ready=WorkerReady("prefill", os.getpid()))))

    def run(self) -> None:
        while True:
            self.receive(block=not self.queue)
            if not self.queue:
                continue  # an abort for a job that had already finished
            inputs, active = self.pack()
            logits = self.runner.forward(inputs)
            done = [a for a, i in zip(active, inputs) if i.sample]
            tokens = self.sampler(logits, [a.job.sampling for a in done], [a.job.output_index for a in done])
            if logits.is_cuda:
                torch.cuda.current_stream().synchronize()  # the KV must be on the device before the decode worker reads it
            self.finish(done, tokens)

    def receive(self, block: bool) -> None:
        if block:
            self.handle(self.decode(self.jobs.recv()))
        while (raw := recv_nowait(self.jobs)) is not None:
            self.handle(self.decode(raw))

    def handle(self, msg: PrefillJob | AbortPrefill | UnitSetup) -> None:
        if isinstance(msg, PrefillJob):
            self.queue.append(ActiveJob(msg, msg.num_cached))
        elif isinstance(msg, AbortPrefill):
            for active in self.queue:
                if active.job.request_id == msg.request_id:
                    self.queue.remove(active)
                    self.notify.send(self.encode(PrefillDone(msg.request_id, None)))
                    return

    def pack(self) -> tuple[list[StepInput], list[ActiveJob]]:
        """The next forward pass: chunks of queued jobs, oldest first, up to the token budget."""
        budget = self.cfg.max_num_batched_tokens
        inputs, active = [], []
        for a in self.queue:
            if budget <= 0:
                break
            todo = len(a.job.token_ids) - a.num_computed
            chunk = min(todo, budget)
            inputs.append(StepInput(a.job.token_ids[a.num_computed:a.num_computed + chunk], a.num_computed,
                                    a.job.block_table, sample=chunk == todo))
            active.append(a)
            a.num_computed += chunk
            budget -= chunk
        return inputs, active

    def finish(self, done: list[ActiveJob], tokens: list[int]) -> None:
        """First tokens to the API server, then the notifications that hand the blocks back to the decode worker."""
        if not done:
            return
        outputs = [RequestOutput(a.job.request_id, a.job.output_index, [t], route="prefill", num_cached_tokens=a.job.num_cached)
                   for a, t in zip(done, tokens)]
        self.out.send(self.encode(WorkerOutput(self.cfg.unit, outputs)))
        for a, t in zip(done, tokens):
            self.queue.remove(a)
            self.notify.send(self.encode(PrefillDone(a.job.request_id, t)))


def run_prefill_worker(cfg: UnitConfig) -> None:
    """Process entry point."""
    init_worker_process(cfg.prefill_cores)
    PrefillWorker(cfg).run()
