"""A worker's way to the API servers: one that does not read (a dead helper) never stalls the
unit."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

import scheduler.worker_setup as worker_setup
from engine.engine import EngineConfig
from scheduler.config import UnitConfig
from scheduler.messages import RequestOutput, WorkerOutput, new_request_id


def test_outputs_for_a_helper_that_does_not_read_are_dropped_not_waited_for(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(worker_setup, "HELPER_QUEUE", 4)
    cfg = UnitConfig(EngineConfig(model="unused"), ipc_dir=str(tmp_path), api_servers=2)
    ctx = zmq.Context()
    reader = ctx.socket(
        zmq.PULL
    )  # API server 0 reads; API server 1 is dead: nobody binds its address
    reader.bind(cfg.outputs_address(0))
    try:
        out = worker_setup.ApiServers(ctx, cfg)
        helper_request = new_request_id(1, 0, "x")
        started = time.monotonic()
        for i in range(50):
            out.send(WorkerOutput(0, [RequestOutput(helper_request, i, [7])]))
        assert time.monotonic() - started < 5 and out.dropped[1] > 0
        out.send(
            WorkerOutput(0, [RequestOutput(new_request_id(0, 0, "y"), 0, [9])])
        )  # API server 0's still arrive
        assert reader.poll(5000)
    finally:
        ctx.destroy(linger=0)
