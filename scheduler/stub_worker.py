"""A stand-in for a unit's workers, for measuring the API server alone (`ppd serve --stub-engine
MS`).

Behind the same messages as the decode worker, it runs no model: every MS milliseconds (one decode
step) it emits the next token of every running request, up to the request's max_tokens, then
finishes it with "length". The tokens are the request's own prompt tokens, in a loop, so that any
tokenizer detokenizes them into real text. It reports ready with the pool size it was given, stats
every STATS_INTERVAL_S, honours aborts and answers logprobs (made-up values) when asked. With it,
what limits streamed tokens/s is the API server, which is the point.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import msgspec
import zmq

from engine.sampling_params import TokenLogprobs
from scheduler.config import UnitConfig
from scheduler.decode_worker import STATS_INTERVAL_S
from scheduler.messages import (
    AbortRequest,
    GenerateRequest,
    Hello,
    RequestOutput,
    ToDecode,
    WorkerOutput,
    WorkerReady,
    WorkerStats,
)
from scheduler.worker_setup import ApiServers, init_worker_process, recv_nowait, requests_socket

log = logging.getLogger("ppd.stub")


@dataclass
class _Running:
    request: GenerateRequest
    index: int = 0  # the next output index


class StubWorker:
    def __init__(self, cfg: UnitConfig, out: ApiServers, ctx: zmq.Context) -> None:
        assert cfg.stub_step_ms is not None
        self.cfg, self.out, self.step_s = cfg, out, cfg.stub_step_ms / 1000
        self.requests = requests_socket(ctx, cfg)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(ToDecode).decode
        self.running: dict[str, _Running] = {}
        self.last_stats = 0.0
        blocks = cfg.engine.num_kv_blocks or 0
        max_len = cfg.engine.max_model_len or 0
        # It stands in for both workers.
        self.readies = (
            [WorkerReady("prefill", os.getpid(), "stub")] if cfg.prefill_worker != "none" else []
        ) + [WorkerReady("decode", os.getpid(), "stub", 0, blocks, max_len)]
        for ready in self.readies:
            self.out.send(WorkerOutput(cfg.unit, stats=self.stats(), ready=ready))
        log.info("stub engine: a token per running request every %g ms", cfg.stub_step_ms)

    def stats(self) -> WorkerStats:
        return WorkerStats(
            num_running=len(self.running),
            num_waiting=0,
            kv_usage=0.0,
            prefix_queries=0,
            prefix_hits=0,
            num_preemptions=0,
            decode_step_ms=self.step_s * 1000,
        )

    def run(self) -> None:
        next_step = time.monotonic()
        while True:
            wait = next_step - time.monotonic() if self.running else STATS_INTERVAL_S
            if wait > 0 and self.requests.poll(int(wait * 1000) + 1):
                while (raw := recv_nowait(self.requests)) is not None:
                    self.handle(self.decode(raw))
                continue
            now = time.monotonic()
            outputs = [self.token(r) for r in list(self.running.values())] if self.running else []
            next_step = max(
                next_step + self.step_s, now
            )  # late: the next step starts now, as a busy engine's
            stats = None
            if now - self.last_stats >= STATS_INTERVAL_S:
                stats, self.last_stats = self.stats(), now
            if outputs or stats:
                self.out.send(WorkerOutput(self.cfg.unit, outputs, stats))

    def handle(self, msg: ToDecode) -> None:
        if isinstance(msg, Hello):
            for ready in self.readies:
                self.out.send_to(
                    msg.api_server, WorkerOutput(self.cfg.unit, stats=self.stats(), ready=ready)
                )
        elif isinstance(msg, GenerateRequest):
            self.running[msg.request_id] = _Running(msg)
        elif isinstance(msg, AbortRequest):
            self.running.pop(msg.request_id, None)
        else:
            for request_id in [r for r in self.running if r.startswith(msg.prefix)]:
                del self.running[request_id]
            self.out.send(WorkerOutput(self.cfg.unit, stats=self.stats(), held=len(self.running)))

    def token(self, r: _Running) -> RequestOutput:
        req, i = r.request, r.index
        prompt = req.prompt_token_ids
        out = RequestOutput(req.request_id, i, [prompt[i % len(prompt)]])
        if i == 0:
            out.route, out.num_cached_tokens = "prefill", 0
        if req.sampling.logprobs is not None:
            out.logprobs = [TokenLogprobs(-1.0, 1, [], [])]
        r.index += 1
        if r.index >= req.sampling.max_tokens:
            out.finish_reason = "length"
            del self.running[req.request_id]
        return out


def run_stub_worker(cfg: UnitConfig) -> None:
    """Process entry point."""
    init_worker_process(cfg, "decode")
    ctx = zmq.Context()
    StubWorker(cfg, ApiServers(ctx, cfg), ctx).run()
