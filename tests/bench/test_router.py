"""`ppd bench router`'s bookkeeping: what counts as a hit, the summary, and the router arguments per
node shape (the runs themselves are in the router suite, tests/router/)."""

from __future__ import annotations

from bench.router import Node, Turn, router_args, summarize


def test_a_later_turn_hits_when_the_previous_prompts_blocks_were_cached() -> None:
    assert Turn(
        0, 1, 200, prompt_tokens=500, cached_tokens=352, previous_prompt_tokens=358
    ).hit  # 22 full blocks
    assert not Turn(0, 1, 200, prompt_tokens=500, cached_tokens=336, previous_prompt_tokens=358).hit
    assert not Turn(0, 1, 429, previous_prompt_tokens=0).hit
    turns = [
        Turn(0, 0, 200, 358),
        Turn(0, 1, 200, 500, 352, 358),
        Turn(1, 1, 200, 500, 0, 358),
        Turn(2, 1, 500),
    ]
    assert summarize(turns) == {
        "requests": 4,
        "ok": 3,
        "later_turns": 3,
        "later_hits": 1,
        "hit_rate": 0.3333,
        "cached_fraction": round(352 / 1000, 4),
    }


def test_router_arguments_name_every_units_events() -> None:
    one = [Node(None, "http://a:1", ["tcp://a:5"]), Node(None, "http://b:1", ["tcp://b:5"])]
    assert router_args("round_robin", one) == []
    args = router_args("kv_aware", one)
    assert args[args.index("--kv-event-model") + 1] == "demo"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--kv-event-source"] == [
        "http://a:1=tcp://a:5",
        "http://b:1=tcp://b:5",
    ]
    two = [Node(None, "http://a:1", ["tcp://a:5", "tcp://a:6"])]
    assert router_args("cache_aware", two) == ["--intra-node-data-parallel-size", "2"]
    assert "http://a:1=tcp://a:5,tcp://a:6" in router_args("kv_aware", two)
