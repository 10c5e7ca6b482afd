"""The ppd policy's decisions on synthetic tables and live states: every branch, the online update,
the fallback, and the table file."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import expected_experts
from engine.prefix_hash import block_hashes
from server.routing.policy import OBSERVATION_WEIGHT, Objective, Outcome, PPDPolicy, UnitLive
from server.routing.policy_table import Cell, PolicyTable, RouteStats, TableError, table_path
from server.routing.router import Router

CONTEXTS = [256, 1024]
SHAPES = [(64, 512), (1024, 64)]  # decode-heavy (ratio 0.125), prefill-heavy (ratio 16)
LOADS = [1, 8]


def stats(ttft: float, tpot: float, queue: float = 0.0) -> RouteStats:
    return RouteStats(
        ttft_p50_ms=ttft,
        ttft_p90_ms=2 * ttft,
        tpot_p50_ms=tpot,
        tpot_p90_ms=2 * tpot,
        queue_delay_ms=queue,
        n=50,
    )


def table(**cells: tuple[RouteStats, RouteStats]) -> PolicyTable:
    """Cells named 'c{context}s{shape}l{load}' -> (prefill stats, decode stats); unnamed cells are
    left out."""
    parsed = {}
    for name, (p, d) in cells.items():
        key = (int(name[1]), int(name[3]), int(name[5]))
        parsed[key] = Cell({"prefill": p, "decode": d})
    return PolicyTable(CONTEXTS, SHAPES, LOADS, parsed, device="test", model="tiny")


def ppd(t: PolicyTable | None, **objective: float) -> PPDPolicy:
    return PPDPolicy(t, Objective(**objective))


LIVE = UnitLive(
    prefill_queue_tokens=0,
    prefill_tokens_per_s=10_000,
    decode_step_ms=10,
    inline_tokens_per_s=10_000,
)


def test_cells_are_found_by_nearest_profiled_point() -> None:
    t = table()
    assert t.key(cached=200, new=60, output=500, load=1) == (0, 0, 0)
    assert t.key(cached=600, new=60, output=500, load=1) == (1, 0, 0)  # past sqrt(256 * 1024) = 512
    assert t.key(cached=300, new=1000, output=50, load=1) == (
        0,
        1,
        0,
    )  # ratio 20: the prefill-heavy shape
    assert t.key(cached=300, new=200, output=100, load=3) == (
        0,
        1,
        1,
    )  # ratio 2 > sqrt(0.125 * 16); load 3 > sqrt(8)


def test_table_decides_each_cell_by_the_weighted_objective() -> None:
    t = table(
        c0s0l0=(
            stats(ttft=100, tpot=10),
            stats(ttft=40, tpot=11),
        ),  # decode saves 60 ms TTFT for 1 ms TPOT
        c0s1l1=(stats(ttft=100, tpot=10), stats(ttft=60, tpot=15)),
    )  # decode saves 40 ms for 5 ms TPOT
    policy = ppd(t)  # w_tpot 10: 60 > 10 (decode); 40 < 50 (prefill)
    d = policy.route(cached=200, new=60, output=500, load=1, live=LIVE)
    assert (d.route, d.reason, d.cell) == ("decode", "table", (0, 0, 0))
    d = policy.route(cached=200, new=1000, output=50, load=8, live=LIVE)
    assert (d.route, d.reason) == ("prefill", "table")
    assert t.cells[(0, 0, 0)].x_star == 1 and t.cells[(0, 1, 1)].x_star == 0
    # Other weights need no new measurement: x* is recomputed from the stored latencies.
    assert (
        ppd(t, w_tpot=100).route(cached=200, new=60, output=500, load=1, live=LIVE).route
        == "prefill"
    )


def test_a_long_prefill_queue_now_overturns_the_table() -> None:
    t = table(c0s1l1=(stats(ttft=100, tpot=10, queue=20), stats(ttft=60, tpot=15)))
    policy = ppd(t)
    assert policy.route(cached=200, new=1000, output=50, load=8, live=LIVE).route == "prefill"
    busy = UnitLive(
        prefill_queue_tokens=2_000, prefill_tokens_per_s=10_000, decode_step_ms=10
    )  # 200 ms queued
    d = policy.route(cached=200, new=1000, output=50, load=8, live=busy)
    assert (d.route, d.reason) == ("decode", "queue") and d.queue_correction_ms == pytest.approx(
        180
    )


def test_a_shorter_queue_than_profiled_does_not_send_appends_to_the_prefill_worker() -> None:
    t = table(
        c0s0l0=(stats(ttft=100, tpot=10, queue=80), stats(ttft=60, tpot=11))
    )  # decode by a margin of 30
    idle = UnitLive(prefill_queue_tokens=0, prefill_tokens_per_s=10_000, decode_step_ms=10)
    d = ppd(t).route(cached=200, new=60, output=500, load=1, live=idle)
    assert (d.route, d.reason, d.queue_correction_ms) == ("decode", "table", 0.0)


def test_without_a_table_the_cost_model_weighs_queue_against_the_inline_slowdown() -> None:
    policy = ppd(None)
    # An idle prefill worker answers 64 new tokens in 6.4 ms; inline waits for 1.5 decode steps (15
    # ms) too.
    d = policy.route(cached=200, new=64, output=512, load=4, live=LIVE)
    assert (d.route, d.reason, d.cell) == ("prefill", "model", None)
    # With 100 ms of prefill work queued ahead, inline wins: its 6.4 ms added to one step, over 512
    # outputs, is cheap.
    queued = UnitLive(
        prefill_queue_tokens=1_000,
        prefill_tokens_per_s=10_000,
        decode_step_ms=10,
        inline_tokens_per_s=10_000,
    )
    assert policy.route(cached=200, new=64, output=512, load=4, live=queued).route == "decode"
    # 4096 new tokens for 4 outputs: 410 ms added to a step, per output token, outweighs that queue.
    assert policy.route(cached=200, new=4096, output=4, load=4, live=queued).route == "prefill"
    # Unless four seconds of prefill work are queued ahead.
    busy = UnitLive(
        prefill_queue_tokens=40_000,
        prefill_tokens_per_s=10_000,
        decode_step_ms=10,
        inline_tokens_per_s=10_000,
    )
    assert policy.route(cached=200, new=4096, output=4, load=4, live=busy).route == "decode"


def test_a_mixture_of_experts_charges_an_append_for_experts_the_decode_batch_does_not_read() -> (
    None
):
    """48 layers of 128 experts, top 8 (Qwen3-30B-A3B): 64 appended tokens read nearly every expert;
    a batch of 64 sequences reads 128 * (1 - (15/16)^64), 98% of them already, one sequence 8 of
    128. At 0.01 ms an expert, the append adds 64 / 10,000 s = 6.4 ms and 0.1 ms of experts to the
    large batch's step, 57 ms to the single sequence's, which tips its route to the prefill
    worker."""
    policy = ppd(None)
    policy.experts = lambda n: expected_experts(n, 48, 128, 8)
    queued = UnitLive(
        prefill_queue_tokens=300,
        prefill_tokens_per_s=10_000,
        decode_step_ms=10,
        inline_tokens_per_s=10_000,
        inline_expert_ms=0.01,
    )
    large, single = replace(queued, decode_batch=64), replace(queued, decode_batch=1)
    assert policy.inline_ms(64, large, 10_000) == pytest.approx(
        6.4 + 0.01 * 48 * 128 * ((1 - 1 / 16) ** 64 - (1 - 1 / 16) ** 128)
    )
    assert policy.inline_ms(64, single, 10_000) == pytest.approx(
        6.4 + 0.01 * 48 * 128 * ((1 - 1 / 16) ** 1 - (1 - 1 / 16) ** 65)
    )
    assert policy.route(cached=200, new=64, output=64, load=4, live=large).route == "decode"
    assert policy.route(cached=200, new=64, output=64, load=4, live=single).route == "prefill"
    # A dense model (no expert count) pays per token only: the same append stays inline.
    policy.experts = None
    assert policy.route(cached=200, new=64, output=64, load=4, live=single).route == "decode"


def test_slo_guards() -> None:
    t = table(c0s0l0=(stats(ttft=100, tpot=10), stats(ttft=40, tpot=11)))
    # Decode is the better route, but its step (10 ms + 64 new tokens at 1000 tokens/s) passes a 50
    # ms ITL SLO.
    slow_inline = UnitLive(
        prefill_tokens_per_s=10_000, decode_step_ms=10, inline_tokens_per_s=1_000
    )
    d = ppd(t, itl_slo_ms=50).route(cached=200, new=64, output=512, load=1, live=slow_inline)
    assert (d.route, d.reason) == ("prefill", "itl_slo")
    # Prefill is the better route by the weights, but it misses a 150 ms TTFT SLO that decode meets.
    t = table(c0s1l1=(stats(ttft=200, tpot=10), stats(ttft=100, tpot=30)))
    d = ppd(t, ttft_slo_ms=150).route(cached=200, new=1000, output=50, load=8, live=LIVE)
    assert (d.route, d.reason) == ("decode", "ttft_slo")
    assert ppd(t).route(cached=200, new=1000, output=50, load=8, live=LIVE).route == "prefill"


def test_observations_move_estimates_boundedly_and_can_flip_a_cell_over_time() -> None:
    t = table(
        c0s0l0=(stats(ttft=100, tpot=10), stats(ttft=80, tpot=11))
    )  # decode by a margin of 10
    policy = ppd(t)
    decision = policy.route(cached=200, new=60, output=500, load=1, live=LIVE)
    assert decision.route == "decode"
    policy.observe(
        decision, Outcome("decode", 200, 60, 500, ttft_ms=1e9, tpot_ms=1e9)
    )  # one absurd outlier
    ttft, tpot = policy.estimates[(0, 0, 0)]["decode"]
    assert ttft == pytest.approx(80 * (1 + OBSERVATION_WEIGHT)) and tpot == pytest.approx(
        11 * (1 + OBSERVATION_WEIGHT)
    )
    assert policy.route(cached=200, new=60, output=500, load=1, live=LIVE).route == "decode"
    for _ in range(30):  # a sustained change: decode really is slow now
        policy.observe(decision, Outcome("decode", 200, 60, 500, ttft_ms=150, tpot_ms=14))
    assert policy.route(cached=200, new=60, output=500, load=1, live=LIVE).route == "prefill"


def test_observed_prefill_ttft_is_taken_without_the_live_queue_it_was_corrected_for() -> None:
    t = table(c0s1l1=(stats(ttft=100, tpot=10, queue=0), stats(ttft=60, tpot=15)))
    policy = ppd(t)
    busy = UnitLive(prefill_queue_tokens=100, prefill_tokens_per_s=10_000)  # 10 ms queued now
    d = policy.route(cached=200, new=1000, output=50, load=8, live=busy)
    assert d.route == "prefill" and d.queue_correction_ms == pytest.approx(10)
    # 100 ms of service plus the 10 ms queue: the estimate stays
    policy.observe(d, Outcome("prefill", 200, 1000, 50, ttft_ms=110, tpot_ms=10))
    assert policy.estimates[(0, 1, 1)]["prefill"][0] == pytest.approx(100)


def test_table_file_round_trip_and_errors(tmp_path: Path) -> None:
    t = table(c0s0l0=(stats(ttft=100, tpot=10), stats(ttft=40, tpot=11))).with_weights(1.0, 10.0)
    t.raw["256x64x512@1:decode"] = {"requests": 3}
    path = tmp_path / "t.json"
    t.save(path)
    back = PolicyTable.load(path)
    assert back.to_json() == t.to_json()
    data = json.loads(path.read_text())
    for broken, message in (
        ({**data, "schema": "other"}, "not a ppd policy table"),
        ({**data, "version": 99}, "version 99"),
        ({**data, "grid": {"contexts": [1]}}, "malformed"),
    ):
        path.write_text(json.dumps(broken))
        with pytest.raises(TableError, match=message):
            PolicyTable.load(path)
    with pytest.raises(TableError, match="cannot read"):
        PolicyTable.load(tmp_path / "missing.json")


def test_default_table_path_names_device_and_model(tmp_path: Path) -> None:
    assert (
        table_path("NVIDIA H100 80GB HBM3", "Llama-3.1-8B", tmp_path).name
        == "nvidia-h100-80gb-hbm3__llama-3.1-8b__policy.json"
    )


@pytest.mark.parametrize("hint", [None, "prefill"])
def test_a_decision_the_table_did_not_make_is_filed_under_the_load_it_was_made_at(
    hint: str | None,
) -> None:
    """A router miss the unit served from its own cache, and a client's route, teach the cell of
    their real load."""
    cells = {
        f"c{c}s{s}l{ld}": (stats(ttft=100, tpot=10), stats(ttft=60, tpot=11))
        for c in range(2)
        for s in range(2)
        for ld in range(2)
    }
    policy = ppd(table(**cells))
    router = Router(num_units=1, block_size=16, policy=policy, capacity_blocks=100)
    for i in range(7):  # seven other conversations in flight
        router.route([1000 * (i + 1) + t for t in range(16)], available=[0])
    prompt = list(range(260))
    if hint is not None:
        router.remember(
            0, block_hashes(prompt, 16)
        )  # the router guesses the prefix is cached, the client routes
    placed = router.route(prompt, available=[0], route_hint=hint)
    assert (
        placed.decision.reason == ("miss" if hint is None else "client")
        and placed.decision.load == 8
    )
    before = {key: [list(v) for v in routes.values()] for key, routes in policy.estimates.items()}
    # The unit found 200 tokens of the prompt in its own cache and ran the append on the prefill
    # worker.
    router.finished(
        0, prompt + [7] * 50, placed, Outcome("prefill", 200, 60, 50, ttft_ms=50, tpot_ms=10)
    )
    moved = [
        key
        for key, routes in policy.estimates.items()
        if [list(v) for v in routes.values()] != before[key]
    ]
    assert moved == [policy.table.key(200, 60, 50, load=8)] == [(0, 0, 1)]
