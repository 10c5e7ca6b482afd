"""The share manager's decisions on a synthetic partition profile of a 4-core device."""

from __future__ import annotations

from partition.manager import ShareManager, Split
from partition.profile import DecodePoint, PartitionProfile, PrefillPoint

CORES = (0, 1, 2, 3)
EVEN = Split((0, 1), (2, 3))
WHOLE = Split(CORES, CORES)


def profile(
    decode: dict[int, float] | None = None, prefill: dict[int, float] | None = None
) -> PartitionProfile:
    """Decode step = 10 ms x batch/8 x (1 + context/1000) on one core, divided by decode[share];
    prefill speed 1000 tok/s x prefill[share]. By default two cores are twice as fast as one, four
    1.4x faster than two."""
    decode = decode or {1: 1.0, 2: 2.0, 3: 2.4, 4: 2.8}
    prefill = prefill or {1: 1.0, 2: 2.0, 3: 2.4, 4: 2.8}
    points = [
        DecodePoint(
            share, batch, context, 10.0 * batch / 8 * (1 + context / 1000) / decode[share], 0.0
        )
        for share in (1, 2, 3, 4)
        for batch in (8, 32)
        for context in (0, 1000)
    ]
    speeds = [
        PrefillPoint(share, prompt, 1000.0 * prefill[share])
        for share in (1, 2, 3, 4)
        for prompt in (128, 1024)
    ]
    return PartitionProfile("cpu-4core", "synthetic", "cores", 4, [1, 2, 3, 4], points, speeds)


def manager(prof: PartitionProfile | None, slo: float | None = None, hold: int = 3) -> ShareManager:
    return ShareManager(CORES, EVEN, prof, slo, hold_steps=hold)


def test_without_a_profile_the_workers_keep_their_cores() -> None:
    m = manager(None, slo=5.0)
    for batch, context, queued in [(0, 0, 500), (32, 1000, 0), (32, 1000, 500), (1, 10, 1)]:
        assert m.decide(batch, context, queued) is None
    assert m.current == EVEN and m.switches == 0


def test_with_both_busy_decode_gets_the_fewest_cores_that_meet_the_slo() -> None:
    # batch 32, context 1000: 80 ms on one core, 40 on two, 33.3 on three, 28.6 on four.
    m = manager(profile(), slo=35.0)
    assert m.decide(32, 1000, 256) == Split((0, 1, 2), (3,))
    assert m.reason == "slo"
    # A lighter batch needs fewer cores: a relief, applied only after it held for hold_steps steps.
    assert [m.decide(8, 0, 256) for _ in range(2)] == [None, None]
    assert m.decide(8, 0, 256) == Split((0,), (1, 2, 3))  # batch 8, context 0: 10 ms on one core


def test_an_slo_no_share_meets_leaves_prefill_one_core() -> None:
    m = manager(profile(), slo=1.0)
    assert m.decide(32, 1000, 256) == Split((0, 1, 2), (3,))
    assert m.reason == "slo_unreachable"


def test_without_an_slo_both_busy_split_evenly() -> None:
    m = ShareManager(
        CORES, Split((0,), (1, 2, 3)), profile(), None, hold_steps=1
    )  # started uneven: 1 + 3
    assert m.decide(32, 1000, 256) is None  # its start is the split it keeps
    m = ShareManager(CORES, WHOLE, profile(), None, hold_steps=1)  # started overlapping: half each
    assert m.decide(32, 1000, 256) == EVEN and m.reason == "even"


def test_a_side_alone_gets_every_core_only_where_the_profile_says_it_pays() -> None:
    m = manager(profile(), slo=100.0, hold=2)
    # Prefill idle, decode busy: decode on 4 cores is 1.4x faster than on its 2: worth it, after the
    # hold.
    assert m.decide(32, 1000, 0) is None
    assert m.decide(32, 1000, 0) == WHOLE and m.reason == "prefill_idle"
    # Work for prefill arrives: the overlap ends at once, whatever the hold (100 ms: one core meets
    # the SLO).
    assert m.decide(32, 1000, 512) == Split((0,), (1, 2, 3))
    # Where more cores buy little (4 cores 1.1x faster than 2), nobody spreads out.
    flat = {1: 1.0, 2: 2.0, 3: 2.1, 4: 2.2}
    m = manager(profile(decode=flat, prefill=flat), slo=100.0, hold=1)
    assert m.decide(32, 1000, 0) is None and m.decide(0, 0, 1024) is None and m.current == EVEN


def test_decode_idle_lets_prefill_spread_where_it_pays() -> None:
    m = manager(profile(), slo=100.0, hold=1)
    assert m.decide(0, 0, 1024) == WHOLE and m.reason == "decode_idle"
    assert m.decide(8, 100, 1024) is not None and not m.current.shared  # decode back: split at once
    assert m.switches == 2


def test_no_flapping_a_relief_that_does_not_hold_is_not_made() -> None:
    m = manager(profile(), slo=35.0, hold=3)
    m.decide(32, 1000, 256)
    heavy = m.current
    for _ in range(10):  # alternating light and heavy steps: the relief never holds for 3 steps
        assert m.decide(8, 0, 256) is None
        assert m.decide(32, 1000, 256) is None
    assert m.current == heavy and m.switches == 1


# ---- a small prefill: beside decode on the whole device, no split
# ------------------------------------------------- With profile() at batch 32, context 1000: decode
# steps 28.6 ms on all 4 cores and 33.3 on the 3 the 35 ms SLO asks for; prefill runs 2,800 tokens/s
# on 4 cores. A split held 3 steps costs decode 3 x 4.8 = 14.3 ms, so a prefill of up to 40 tokens
# (14.3 ms) runs beside decode instead.


def test_a_small_prefill_leaves_decode_the_whole_device() -> None:
    m = ShareManager(CORES, WHOLE, profile(), 35.0, hold_steps=3)
    assert m.target(32, 1000, 30) == (WHOLE, "small_prefill")
    assert m.decide(32, 1000, 30) is None and m.current == WHOLE and m.switches == 0


def test_a_large_prefill_splits_at_once_and_the_relief_waits_for_the_hold() -> None:
    m = ShareManager(CORES, WHOLE, profile(), 35.0, hold_steps=3)
    assert m.decide(32, 1000, 256) == Split((0, 1, 2), (3,)) and m.reason == "slo"
    assert [m.decide(32, 1000, 30) for _ in range(2)] == [
        None,
        None,
    ]  # small again: the overlap waits its hold
    assert m.decide(32, 1000, 30) == WHOLE and m.reason == "small_prefill"
    for _ in range(
        5
    ):  # large and small queues alternating: the first large one splits at once, no relief holds
        m.decide(32, 1000, 256)
        assert m.decide(32, 1000, 30) is None
    assert not m.current.shared and m.switches == 3  # split, relief, split


def test_the_threshold_follows_decodes_step_and_what_the_split_costs_it() -> None:
    # Where decode's step is short (batch 8, context 0: 3.6 ms on 4 cores), even a long hold lets
    # only a prefill that ends within that step run unsplit: 5 tokens do (the fastest pass, 3.6 ms),
    # 30 (10.7 ms) do not.
    m = ShareManager(CORES, WHOLE, profile(), 35.0, hold_steps=100)
    assert m.target(8, 0, 5) == (WHOLE, "small_prefill")
    assert m.target(8, 0, 30) == (Split((0,), (1, 2, 3)), "slo")
    # Where decode loses nothing on its share (3 cores as fast as 4), the split costs it nothing:
    # always split.
    flat_top = {1: 1.0, 2: 2.0, 3: 2.8, 4: 2.8}
    m = ShareManager(CORES, WHOLE, profile(decode=flat_top), 35.0, hold_steps=3)
    assert m.target(32, 1000, 1) == (Split((0, 1, 2), (3,)), "slo")


def test_without_a_profile_a_small_prefill_splits_as_before() -> None:
    m = sm_manager(None)
    assert m.decide(64, 512, 0) == Split(SMS, SMS)
    assert m.decide(64, 512, 16) == Split(SMS[:64], SMS[64:]) and m.reason == "no_profile"


# ---- green-context splits: SMs as units, decode's share one of the splits made at start ----------

SMS = tuple(range(132))
SPLITS = (32, 64, 96)


def sm_profile() -> PartitionProfile:
    """Decode on an H100-like device: 32 SMs take 30 ms at batch 64, 64 SMs 15 ms, 96 and more 10
    ms."""
    speed = {16: 0.5, 32: 1.0, 64: 2.0, 96: 3.0, 132: 3.0}
    points = [
        DecodePoint(share, batch, context, 30.0 * batch / 64 / speed[share], 0.0)
        for share in speed
        for batch in (1, 64)
        for context in (512, 4096)
    ]
    speeds = [PrefillPoint(share, 1024, 100.0 * share) for share in speed]
    return PartitionProfile("H100", "synthetic", "sms", 132, sorted(speed), points, speeds)


def sm_manager(prof: PartitionProfile | None, slo: float | None = None) -> ShareManager:
    return ShareManager(
        SMS, Split(SMS[:64], SMS[64:]), prof, slo, hold_steps=1, sizes=SPLITS, free_switches=True
    )


def test_decode_gets_the_smallest_split_that_meets_the_slo() -> None:
    m = sm_manager(sm_profile(), slo=20.0)
    # 16 SMs are too slow (60 ms), 32 too (30 ms), 64 meet 20 ms (15 ms): the 64-SM split.
    assert m.decide(64, 512, 1024) is None and m.current == Split(SMS[:64], SMS[64:])
    m = sm_manager(sm_profile(), slo=35.0)
    # The profile says 16 SMs would do at batch 32 (30 ms), but no split gives decode 16: the next
    # one up, 32.
    assert len(m.decide(32, 512, 1024).decode) == 32 and m.reason == "slo"
    m = sm_manager(sm_profile(), slo=5.0)
    assert len(m.decide(64, 512, 1024).decode) == 96 and m.reason == "slo_unreachable"


def test_without_a_profile_free_switches_give_a_side_alone_the_whole_device() -> None:
    m = sm_manager(None)
    assert m.decide(64, 512, 0) == Split(SMS, SMS) and m.reason == "prefill_idle"
    assert m.decide(64, 512, 1024) == Split(
        SMS[:64], SMS[64:]
    )  # a prefill arrived: back to the even split at once
    assert m.decide(0, 0, 1024) == Split(SMS, SMS) and m.reason == "decode_idle"
    # Pinned cores move threads, which costs: without a profile they stay put (the first test in
    # this file).


def test_on_green_splits_a_small_prefill_keeps_decode_on_every_sm() -> None:
    # sm_profile at batch 64: decode steps 10 ms on all 132 SMs, 15 ms on its 64; prefill 13,200
    # tokens/s on all. With a hold of one step the split costs decode 5 ms: 50 tokens (3.8 ms) run
    # beside it, 1,024 (78 ms) split.
    m = sm_manager(sm_profile())
    # A side alone gets every SM where switching is free, though the profile's 96 SMs are as fast as
    # 132.
    assert m.decide(64, 512, 0) == Split(SMS, SMS) and m.reason == "prefill_idle"
    assert (
        m.target(64, 512, 50) == (Split(SMS, SMS), "small_prefill")
        and m.decide(64, 512, 50) is None
    )
    assert m.decide(64, 512, 1024) == Split(SMS[:64], SMS[64:]) and m.reason == "even"
