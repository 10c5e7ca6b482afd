"""The admission's estimate of the time between starts, which the predicted wait (and so the 429s) rests on."""

from __future__ import annotations

import pytest

from server.engine_client import StartRate

STEP = 0.02


def test_a_burst_started_in_whole_batches_predicts_one_step_per_batch() -> None:
    # 256 requests arrive together at t=0; every step starts all of them that are still queued (a stub-like unit).
    rate = StartRate()
    for i in range(128):  # step 1 starts half (the first batch: nothing was queued before it, no sample)
        rate.started(1 * STEP, arrival=0.0)
    for i in range(128):  # step 2 starts the rest, which were queued at the previous start
        rate.started(2 * STEP, arrival=0.0)
    rate.started(3 * STEP, arrival=2.5 * STEP)  # the next batch completes the sample of step 2's
    assert rate.interval_s == pytest.approx(STEP / 128)
    # 1,000 waiting requests are then predicted to wait 8 steps, not 1,000.
    assert 1000 * rate.interval_s == pytest.approx(1000 / 128 * STEP)


def test_one_start_per_step_under_a_backlog_measures_the_step() -> None:
    rate = StartRate()
    for step in range(1, 6):
        rate.started(step * STEP, arrival=0.0)
    rate.started(6 * STEP, arrival=5.5 * STEP)
    assert rate.interval_s == pytest.approx(STEP)


def test_starts_of_requests_that_arrived_after_the_previous_start_measure_nothing() -> None:
    rate = StartRate()
    for step in range(1, 6):  # an idle unit: each request arrives after the previous one started
        rate.started(step * 1.0, arrival=step * 1.0 - 0.01)
    assert rate.interval_s is None
