"""The admission's estimate of the time between starts, which the predicted wait (and so the 429s)
rests on."""

from __future__ import annotations

import pytest

from server.engine_client import START_INTERVAL_MIN_SAMPLES, StartRate

STEP = 0.02


def test_a_burst_started_in_whole_batches_predicts_one_step_per_batch() -> None:
    # 768 requests arrive together at t=0; every step starts 128 of those still queued (a stub-like
    # unit).
    rate = StartRate()
    for step in range(1, 7):  # step 1 is the first batch: nothing was queued before it, no sample
        for _ in range(128):
            rate.started(step * STEP, arrival=0.0)
    rate.started(7 * STEP, arrival=6.5 * STEP)  # the next batch completes the sample of step 6's
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


def test_too_few_samples_predict_nothing() -> None:
    # A burst's first steps: a wait predicted from them would refuse requests the next steps start.
    rate = StartRate()
    # The first batch measures nothing and the latest is not complete: n + 1 batches are n - 1
    # samples.
    for step in range(1, START_INTERVAL_MIN_SAMPLES + 2):
        rate.started(step * 10 * STEP, arrival=0.0)
    assert rate.interval_s is None
    rate.started((START_INTERVAL_MIN_SAMPLES + 2) * 10 * STEP, arrival=0.0)
    assert rate.interval_s == pytest.approx(10 * STEP)


def test_one_slow_step_does_not_set_the_estimate() -> None:
    # A partition's first prefill of a burst takes 50 steps' time; the steps after it are normal.
    rate = StartRate()
    times = [STEP, 51 * STEP] + [51 * STEP + k * STEP for k in range(1, 8)]
    for now in times:
        rate.started(now, arrival=0.0)
    assert rate.interval_s == pytest.approx(STEP)
