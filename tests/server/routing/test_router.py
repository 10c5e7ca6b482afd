"""Unit choice (sessions, prefix affinity, load) and the route a placement carries."""

from __future__ import annotations

import pytest

from server.routing.policy import Policy, UnitLive, make_policy
from server.routing.router import Router

BS = 4


def route(policy: Policy, cached: int, new: int) -> str:
    return policy.route(cached, new, output=16, load=1, live=UnitLive()).route


def test_static_policies_route_append_prefills() -> None:
    assert route(Policy("pd"), cached=64, new=8) == "prefill"
    assert route(Policy("dlocal"), cached=64, new=5000) == "decode"
    assert route(Policy("aggregated"), cached=0, new=100) == "decode"


@pytest.mark.parametrize("name", ["pd", "dlocal", "ppd"])
def test_a_prompt_without_cached_prefix_always_prefills_on_the_prefill_worker(name: str) -> None:
    decision = make_policy(name).route(0, 3, output=16, load=1, live=UnitLive())
    assert (decision.route, decision.reason) == ("prefill", "miss")


def test_later_turn_follows_its_prefix_and_new_conversations_balance() -> None:
    router = Router(num_units=2, block_size=BS, policy=Policy("dlocal"), capacity_blocks=100)
    conv_a = list(range(100, 120))
    a1 = router.route(conv_a, available=[0, 1])
    b1 = router.route(list(range(200, 220)), available=[0, 1])
    assert a1.unit != b1.unit  # least loaded
    assert (a1.route, a1.est_cached_tokens) == ("prefill", 0)
    router.finished(a1.unit, conv_a + [1, 2, 3, 4])
    router.finished(b1.unit, list(range(200, 220)))
    a2 = router.route(conv_a + [1, 2, 3, 4] + [9] * 7, available=[0, 1])
    assert a2.unit == a1.unit and a2.route == "decode" and a2.est_cached_tokens == 24


def test_edited_history_matches_only_up_to_the_edit() -> None:
    router = Router(num_units=1, block_size=BS, policy=make_policy("ppd"), capacity_blocks=100)
    router.route(list(range(16)), available=[0])
    edited = list(range(8)) + [99] + list(range(9, 16))
    assert router.route(edited, available=[0]).est_cached_tokens == 8


def test_only_available_units_are_chosen_and_restart_forgets() -> None:
    router = Router(num_units=2, block_size=BS, policy=Policy("dlocal"), capacity_blocks=100)
    conv = list(range(40))
    first = router.route(conv, available=[0, 1])
    other = 1 - first.unit
    assert router.route(conv, available=[other]).unit == other
    router.forget_unit(first.unit)
    assert router.route(conv, available=[first.unit]).est_cached_tokens == 0


def test_index_is_bounded_lru() -> None:
    router = Router(num_units=1, block_size=BS, policy=Policy("dlocal"), capacity_blocks=3)
    router.route(list(range(8)), available=[0])  # 2 blocks
    router.route(list(range(100, 108)), available=[0])  # 2 more: the oldest block goes
    assert router.route(list(range(8)), available=[0]).est_cached_tokens == 0


def test_sequential_new_conversations_spread_over_units() -> None:
    router = Router(num_units=2, block_size=BS, policy=make_policy("ppd"), capacity_blocks=100)
    units = []
    for i in range(4):
        placed = router.route([1000 * (i + 1) + t for t in range(8)], available=[0, 1])
        router.finished(placed.unit, [])
        units.append(placed.unit)
    assert sorted(units) == [0, 0, 1, 1]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_session_keeps_its_unit_against_prefix_and_load_until_idle_too_long() -> None:
    clock = Clock()
    router = Router(
        num_units=2,
        block_size=BS,
        policy=Policy("dlocal"),
        capacity_blocks=100,
        session_ttl_s=60,
        clock=clock,
    )
    first = router.route(list(range(40)), available=[0, 1], session="s1")
    other = 1 - first.unit
    # Another conversation fills the first unit's load; a new prompt of session s1 with no prefix
    # still goes home.
    router.route(list(range(500, 540)), available=[0, 1])
    clock.now = 59
    assert router.route(list(range(900, 940)), available=[0, 1], session="s1").unit == first.unit
    # After a quiet spell longer than the TTL the session is forgotten: the least loaded unit takes
    # it.
    clock.now = 59 + 61
    assert router.route(list(range(700, 740)), available=[0, 1], session="s1").unit == other


def test_session_whose_unit_restarted_or_is_unavailable_goes_to_the_best_unit() -> None:
    router = Router(num_units=2, block_size=BS, policy=Policy("dlocal"), capacity_blocks=100)
    conv = list(range(40))
    first = router.route(conv, available=[0, 1], session="s")
    other = 1 - first.unit
    assert (
        router.route(conv + [1] * 8, available=[other], session="s").unit == other
    )  # home unit not ready
    router.forget_unit(other)
    router.finished(first.unit, conv)
    placed = router.route(conv + [1] * 8, available=[0, 1], session="s")
    assert (
        placed.unit == first.unit and placed.est_cached_tokens == 40
    )  # back where its prefix still is


def test_client_route_hint_overrides_the_policy_for_an_append_only() -> None:
    router = Router(num_units=1, block_size=BS, policy=Policy("pd"), capacity_blocks=100)
    assert (
        router.route(list(range(16)), available=[0], route_hint="decode").route == "prefill"
    )  # a miss
    placed = router.route(list(range(16)) + [5, 6], available=[0], route_hint="decode")
    assert (placed.route, placed.decision.reason) == ("decode", "client")


def _api_servers(n: int) -> list[Router]:
    """n API servers' routers joined as the router bus joins them: every event reaches every other
    one."""
    routers = [
        Router(num_units=2, block_size=BS, policy=Policy("dlocal"), capacity_blocks=100)
        for _ in range(n)
    ]
    for i, router in enumerate(routers):
        router.origin = i
        router.publish = lambda event, i=i: [
            r.apply(event) for j, r in enumerate(routers) if j != i
        ]
    return routers


def test_api_servers_share_placements_sessions_and_load() -> None:
    a, b = _api_servers(2)
    a.route(
        [99] * BS, [0]
    )  # unit 0 is busier: the conversation goes to unit 1, where b alone would not look
    first = list(range(3 * BS))
    placed = a.route(first, [0, 1])
    assert placed.unit == 1
    # A conversation's next turn reaches the other API server: it follows its prefix there too.
    answer = [900 + i for i in range(BS)]
    a.finished(placed.unit, first + answer)
    again = b.route(first + answer + [7] * BS, [0, 1])
    assert again.unit == placed.unit and again.est_cached_tokens == len(first) + BS
    # A session placed through one API server keeps its unit through the other, against the prefix.
    s = b.route([5] * BS, [0, 1], session="s")
    other = 1 - s.unit
    a.route([42] * (4 * BS), [other])  # the other unit now holds a longer match for the next prompt
    a.finished(other, [42] * (4 * BS))
    assert a.route([42] * (4 * BS), [0, 1], session="s").unit == s.unit
    # Each counts the other's requests in the units' load: both see the same.
    assert a.load == b.load and sum(a.load) == 4


def test_an_api_servers_new_conversations_balance_with_the_others() -> None:
    a, b = _api_servers(2)
    units = [
        r.route([1000 * i + t for t in range(BS)], [0, 1]).unit for i, r in enumerate([a, b, a, b])
    ]
    assert sorted(units) == [
        0,
        0,
        1,
        1,
    ]  # alone, each would have put its first two on unit 0 then 1: the same


def test_a_finished_request_hashes_only_its_answer_and_the_placement_carries_the_prompts() -> None:
    """The router's index learns the same blocks whether the prompt's hashes are reused or computed
    again."""
    from engine.prefix_hash import block_hashes

    conv = list(range(100, 121))  # 5 full blocks and a token
    answer = [1, 2, 3, 4, 5, 6]
    reused, fresh = (
        Router(num_units=1, block_size=BS, policy=Policy("dlocal"), capacity_blocks=100)
        for _ in "ab"
    )
    placed = reused.route(conv, available=[0])
    assert placed.hashes == block_hashes(conv, BS), "the prompt's hashes travel with its placement"
    reused.finished(0, conv + answer, placed)
    fresh.route(conv, available=[0])
    fresh.finished(0, conv + answer)
    assert list(reused.index[0]) == list(fresh.index[0]) == block_hashes(conv + answer, BS)


def test_the_hashes_a_placement_carries_are_the_ones_the_units_block_manager_keys_by() -> None:
    """The decode worker matches and caches a prompt's blocks under the router's hashes (they come
    with the request): a later prompt the worker hashes itself finds them, and a GenerateRequest
    carries them intact."""
    import msgspec

    from engine.block_manager import BlockManager
    from engine.sampling_params import SamplingParams
    from scheduler.messages import GenerateRequest

    prompt = list(range(1000, 1018))  # 4 full blocks and 2 tokens
    placed = Router(num_units=1, block_size=BS, policy=Policy("pd"), capacity_blocks=100).route(
        prompt, [0]
    )
    sent = GenerateRequest("r", prompt, SamplingParams(), "prefill", block_hashes=placed.hashes)
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=GenerateRequest)
    assert got.block_hashes == placed.hashes and len(placed.hashes) == 4
    blocks = BlockManager(num_blocks=16, block_size=BS)
    assert blocks.allocate("a", prompt, hashes=got.block_hashes) == 0
    blocks.cache_blocks("a", prompt, len(prompt))
    assert sorted(blocks._hash_to_block) == sorted(placed.hashes)
    assert blocks.allocate("b", prompt + [7]) == 16


def test_an_event_that_cannot_be_published_neither_fails_the_request_nor_leaks_its_load() -> None:
    """Router events are hints: a bus that raises (a full queue, a closed socket) costs the other
    API servers a hint, never the request its router placed, and the load it counted is given
    back when the request ends."""
    router = Router(num_units=1, block_size=BS, policy=Policy("dlocal"), capacity_blocks=100)

    def full(event) -> None:
        raise RuntimeError("the bus is full")

    router.publish = full
    placed = router.route(list(range(16)), available=[0])
    assert router.load == [1]
    router.finished(placed.unit, list(range(16)), placed)
    assert router.load == [0]


def test_what_the_pool_index_lets_go_is_cached_in_the_units_tier_at_its_load_cost() -> None:
    policy = make_policy("ppd")
    policy.tier_tokens_per_s = 1000.0  # as `ppd profile tier` measured it
    router = Router(num_units=1, block_size=BS, policy=policy, capacity_blocks=3)
    router.tier_capacity[0] = 8  # as the unit's stats said
    first = list(range(12))  # 3 blocks
    router.route(first, available=[0])
    router.route(list(range(100, 112)), available=[0])  # the pool index lets the first three go
    again = router.route(first + [7] * 5, available=[0])
    assert (again.est_cached_tokens, again.est_loaded_tokens) == (12, 12)
    assert again.decision.load_ms == pytest.approx(12.0)  # 12 tokens at 1000 tokens/s
    # The unit's own measure of its rate wins over the profile's.
    assert policy.load_ms(12, UnitLive(tier_tokens_per_s=4000.0)) == pytest.approx(3.0)
    router.forget_unit(0)  # a restarted unit's tier is empty
    assert router.route(first + [9], available=[0]).est_cached_tokens == 0


def test_without_a_tier_the_pool_index_lets_go_for_good() -> None:
    router = Router(num_units=1, block_size=BS, policy=Policy("dlocal"), capacity_blocks=3)
    router.route(list(range(12)), available=[0])
    router.route(list(range(100, 112)), available=[0])
    placed = router.route(list(range(12)) + [1], available=[0])
    assert (placed.est_cached_tokens, placed.est_loaded_tokens) == (0, 0)
