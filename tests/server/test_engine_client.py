"""The engine client's boundaries: the router bus and the output reader fail loudly and free what they held."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from engine.engine import EngineConfig
from scheduler.config import UnitConfig
from scheduler.messages import Placed
from server.engine_client import RouterBus


def unit_config(tmp_path: Path, api_servers: int = 1) -> UnitConfig:
    return UnitConfig(EngineConfig(model="unused"), ipc_dir=str(tmp_path), policy="dlocal", api_servers=api_servers)


def test_a_full_router_bus_drops_events_counted_and_never_raises(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An API server whose events go unread (API server 0 is not reading them) drops the ones past the queue's
    bound: counted, logged once, and never an exception in the request that published it."""
    async def main() -> RouterBus:
        ctx = zmq.asyncio.Context()
        bus = RouterBus(ctx, unit_config(tmp_path, api_servers=2), 1)  # no API server 0 listens
        try:
            for _ in range(1500):  # past the socket's high-water mark of 1,000
                bus.publish(Placed(1, 0, [1, 2, 3]))
            gc.collect()  # a future that held an exception no one retrieved is logged when it goes
            await asyncio.sleep(0)
        finally:
            ctx.destroy(linger=0)
        return bus

    with caplog.at_level(logging.WARNING):
        bus = asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert bus.dropped >= 400
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1

