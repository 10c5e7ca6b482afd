"""The engine client's boundaries: the router bus and the output reader fail loudly and free what
they held."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from engine.demo import demo_model_path
from engine.engine import EngineConfig
from engine.sampling_params import SamplingParams
from scheduler.config import UnitConfig
from scheduler.messages import (
    AbortRequest,
    GenerateRequest,
    Placed,
    RequestOutput,
    ToDecode,
    WorkerOutput,
    WorkerReady,
)
from server.api import build_app
from server.engine_client import READER, EngineClient, EngineError, RouterBus
from server.metrics import Metrics
from server.request_path import ServedModel
from server.routing.policy import Policy
from server.routing.router import Router
from server.serve import load_tokenizer


def unit_config(tmp_path: Path, api_servers: int = 1) -> UnitConfig:
    return UnitConfig(
        EngineConfig(model="unused"),
        ipc_dir=str(tmp_path),
        policy="dlocal",
        api_servers=api_servers,
    )


def test_a_full_router_bus_drops_events_counted_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An API server whose events go unread (API server 0 is not reading them) drops the ones past
    the queue's bound: counted, logged once, and never an exception in the request that published
    it."""

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


class StubUnit:
    """A unit that answers each request with one token and keeps it running; it keeps the aborts it
    is sent."""

    def __init__(self, cfg: UnitConfig, ctx: zmq.asyncio.Context) -> None:
        self.cfg = cfg
        self.requests = ctx.socket(zmq.PULL)
        self.requests.connect(cfg.requests_address(0))
        self.out = ctx.socket(zmq.PUSH)
        self.out.connect(cfg.outputs_address(0))
        self.encode, self.decode = (
            msgspec.msgpack.Encoder().encode,
            msgspec.msgpack.Decoder(ToDecode).decode,
        )
        self.aborted: list[str] = []

    async def send(self, msg: WorkerOutput) -> None:
        await self.out.send(self.encode(msg))

    async def run(self) -> None:
        for role in ("prefill", "decode"):
            await self.send(
                WorkerOutput(self.cfg.unit, ready=WorkerReady(role, 1, "stub", 0, 4096, 4096))
            )
        while True:
            msg = self.decode(await self.requests.recv())
            if isinstance(msg, GenerateRequest):
                first = RequestOutput(msg.request_id, 0, [7], route="prefill", num_cached_tokens=0)
                await self.send(WorkerOutput(self.cfg.unit, [first], started=[msg.request_id]))
            elif isinstance(msg, AbortRequest):
                self.aborted.append(msg.request_id)


async def until(predicate, timeout: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


def test_a_reader_that_fails_ends_its_requests_with_500_says_so_on_health_and_is_restarted(
    tmp_path: Path,
) -> None:
    """The output reader is the only way from the workers to the requests: when it raises (here on a
    message for a unit that does not exist), the requests in flight end with a 500 at once instead
    of waiting forever, their unit is told to stop them, /health answers 503 naming the reader, and
    the reader runs again."""
    folder = demo_model_path()
    model = ServedModel("demo", str(folder), load_tokenizer(str(folder), None), 4096, 320, (257,))

    async def main() -> None:
        cfg = unit_config(tmp_path)
        client = EngineClient([cfg], Router(1, 16, Policy("dlocal"), 4096), Metrics("stub"))
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(model, client, lambda: [{"ready": True}])),
            base_url="http://ppd",
        )
        ctx = zmq.asyncio.Context()
        unit = StubUnit(cfg, ctx)
        serving = asyncio.create_task(unit.run())
        client.start()
        try:
            await asyncio.wait_for(client.state[0].ready_event.wait(), 10)
            stream = client.generate(list(range(10)), SamplingParams(max_tokens=100))
            assert (await asyncio.wait_for(anext(stream), 10)).token_ids == [7]
            [request_id] = client.requests
            await unit.send(WorkerOutput(unit=5))
            with pytest.raises(EngineError) as failed:
                await asyncio.wait_for(anext(stream), 5)
            assert failed.value.status == 500 and "output reader failed" in failed.value.message
            health = await http.get("/health")
            assert (
                health.status_code == 503
                and "the output reader failed (IndexError" in health.json()["problems"][0]
            )
            assert client.refusal().status == 503
            await until(
                lambda: unit.aborted == [request_id], 5, "the unit to be told to stop the request"
            )
            assert client.router.load == [0] and client.state[0].waiting == 0
            await until(
                lambda: READER not in client.problems, 5, "the restarted reader to be healthy"
            )
            assert (await http.get("/health")).status_code == 200
            again = client.generate(list(range(20)), SamplingParams(max_tokens=100))
            assert (await asyncio.wait_for(anext(again), 10)).token_ids == [7]
            await again.aclose()
        finally:
            serving.cancel()
            client.close()
            ctx.destroy(linger=0)
            await http.aclose()

    asyncio.run(main())
