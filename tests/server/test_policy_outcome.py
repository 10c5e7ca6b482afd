"""The policy learns from what a request did, not from the router's guess: a stub unit that answers
`prefill` (a cold prefill, or a shorter prefix than the router thought it held) to a `decode`
decision leaves the decode estimates alone, and what it did moves the estimate of its own route in
the cell of what it was."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engine.engine import EngineConfig
from engine.sampling_params import SamplingParams
from scheduler.config import UnitConfig
from scheduler.messages import GenerateRequest, RequestOutput, ToDecode, WorkerOutput, WorkerReady
from server.engine_client import EngineClient
from server.metrics import Metrics
from server.routing.policy import Decision, Objective, Outcome, PPDPolicy
from server.routing.router import Router
from tests.server.routing.test_policy import stats, table

BLOCK = 16
ANSWER = 6


class RecordingPolicy(PPDPolicy):
    def __init__(self) -> None:
        # Every cell: decode is far better (a 100 ms TTFT gap against 1 ms of TPOT).
        cells = {
            f"c{c}s{s}l{ld}": (stats(ttft=200, tpot=10), stats(ttft=100, tpot=11))
            for c in range(3)
            for s in range(2)
            for ld in range(3)
        }
        super().__init__(table(**cells), Objective())
        self.decisions: list[Decision] = []
        self.outcomes: list[Outcome] = []

    def route(self, *args, **kwargs) -> Decision:  # type: ignore[override]
        self.decisions.append(super().route(*args, **kwargs))
        return self.decisions[-1]

    def observe(self, decision: Decision, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        super().observe(decision, outcome)


async def stub_unit(cfg: UnitConfig, ctx: zmq.asyncio.Context, cached: list[int]) -> None:
    """A unit that runs every prefill on the prefill worker, finding cached.pop(0) tokens of the
    prompt cached, and answers ANSWER tokens."""
    requests = ctx.socket(zmq.PULL)
    requests.connect(cfg.requests_address(0))
    out = ctx.socket(zmq.PUSH)
    out.connect(cfg.outputs_address(0))
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(ToDecode).decode
    for role in ("prefill", "decode"):
        await out.send(
            encode(WorkerOutput(cfg.unit, ready=WorkerReady(role, 1, "stub", 0, 4096, 4096)))
        )
    while True:
        msg = decode(await requests.recv())
        if not isinstance(msg, GenerateRequest):
            continue
        await out.send(
            encode(
                WorkerOutput(
                    cfg.unit,
                    [
                        RequestOutput(
                            msg.request_id, 0, [7], route="prefill", num_cached_tokens=cached.pop(0)
                        )
                    ],
                    started=[msg.request_id],
                )
            )
        )
        await asyncio.sleep(0.01)
        await out.send(
            encode(
                WorkerOutput(
                    cfg.unit,
                    [RequestOutput(msg.request_id, 1, [7] * (ANSWER - 1), finish_reason="stop")],
                )
            )
        )


async def run(prompt: list[int], client: EngineClient) -> list[int]:
    tokens = []
    async for delta in client.generate(prompt, SamplingParams(max_tokens=64)):
        tokens += delta.token_ids
    return tokens


def test_a_prefill_answer_to_a_decode_guess_teaches_the_route_taken(tmp_path: Path) -> None:
    async def main() -> RecordingPolicy:
        cfg = UnitConfig(EngineConfig(model="unused"), ipc_dir=str(tmp_path), policy="ppd")
        policy = RecordingPolicy()
        client = EngineClient([cfg], Router(1, BLOCK, policy, 4096), Metrics("stub"))
        ctx = zmq.asyncio.Context()
        cached = [
            0,
            0,
            BLOCK,
        ]  # turn 1: a miss; turn 2: the prefix was evicted; turn 3: one block of it is left
        unit = asyncio.create_task(stub_unit(cfg, ctx, cached))
        client.start()
        try:
            await asyncio.wait_for(client.state[0].ready_event.wait(), 10)
            history = list(range(100, 140))
            for turn in range(3):
                history += await run(history, client) + [200 + turn] * 20
        finally:
            unit.cancel()
            client.close()
            ctx.destroy(linger=0)
        return policy

    policy = asyncio.run(main())
    before = RecordingPolicy().estimates
    first, second, third = policy.decisions
    assert first.route == "prefill" and second.route == third.route == "decode", (
        "the router guessed decode"
    )
    assert [o.route for o in policy.outcomes] == ["prefill"] * 3 and [
        o.cached for o in policy.outcomes
    ] == [0, 0, BLOCK]
    last = policy.outcomes[2]
    assert last.new == 40 + ANSWER + 20 + ANSWER + 20 - BLOCK and last.output == ANSWER
    moved = policy.table.key(BLOCK, last.new, ANSWER, third.load)
    for key, routes in policy.estimates.items():
        assert routes["decode"] == before[key]["decode"], f"a decode estimate moved in cell {key}"
        if key != moved:
            assert routes["prefill"] == before[key]["prefill"], (
                f"cell {key} learned from a request not of it"
            )
    assert policy.estimates[moved]["prefill"][0] < before[moved]["prefill"][0], (
        "the cold prefill's TTFT was learned"
    )
