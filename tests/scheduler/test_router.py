"""Unit choice (prefix affinity, load) and route choice (policies)."""

from __future__ import annotations

import pytest

from scheduler.policy import Policy
from scheduler.router import Router

BS = 4


def test_policies_route_append_prefills() -> None:
    assert Policy("pd").route(num_cached=64, num_new=8) == "prefill"
    assert Policy("dlocal").route(num_cached=64, num_new=5000) == "decode"
    assert Policy("aggregated").route(num_cached=0, num_new=100) == "decode"
    ppd = Policy("ppd", ppd_max_append=100)
    assert ppd.route(num_cached=64, num_new=100) == "decode"
    assert ppd.route(num_cached=64, num_new=101) == "prefill"


@pytest.mark.parametrize("name", ["pd", "dlocal", "ppd"])
def test_a_prompt_without_cached_prefix_always_prefills_on_the_prefill_worker(name: str) -> None:
    assert Policy(name).route(num_cached=0, num_new=3) == "prefill"


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
    router = Router(num_units=1, block_size=BS, policy=Policy("ppd"), capacity_blocks=100)
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
    router.route(list(range(8)), available=[0])            # 2 blocks
    router.route(list(range(100, 108)), available=[0])     # 2 more: the oldest block goes
    assert router.route(list(range(8)), available=[0]).est_cached_tokens == 0


def test_sequential_new_conversations_spread_over_units() -> None:
    router = Router(num_units=2, block_size=BS, policy=Policy("ppd"), capacity_blocks=100)
    units = []
    for i in range(4):
        decision = router.route([1000 * (i + 1) + t for t in range(8)], available=[0, 1])
        router.finished(decision.unit, [])
        units.append(decision.unit)
    assert sorted(units) == [0, 0, 1, 1]
