"""The admission wait policy, driven by a fake clock (plain numbers), never by sleeps."""

from __future__ import annotations

import math

import pytest

from engine.core.admission import AdmissionWait, retry_after_s
from engine.request import SamplingParams, steps_to_run


def remaining(
    wait: AdmissionWait,
    now: float,
    *,
    running: int = 0,
    full: bool = False,
    head: float = 0.0,
    last: float = 0.0,
) -> float:
    return wait.remaining(now, num_running=running, batch_full=full, head_arrival=head, last_arrival=last)


def test_zero_wait_never_waits() -> None:
    assert remaining(AdmissionWait.from_ms(0), 0.0) == 0.0


def test_no_wait_while_a_batch_runs() -> None:
    assert remaining(AdmissionWait.from_ms(100), 0.0, running=3) == 0.0


def test_full_batch_ends_the_wait() -> None:
    assert remaining(AdmissionWait.from_ms(100), 0.0, full=True) == 0.0


def test_quiet_window_is_min_of_50ms_and_a_fifth_of_the_wait() -> None:
    assert AdmissionWait.from_ms(100).quiet_window_s == pytest.approx(0.020)
    assert AdmissionWait.from_ms(1000).quiet_window_s == pytest.approx(0.050)


def test_arrivals_going_quiet_end_the_wait() -> None:
    wait = AdmissionWait.from_ms(1000)  # quiet window 50 ms
    # The last arrival was at t=0.10: wait until 0.15 at most.
    assert remaining(wait, 0.12, head=0.0, last=0.10) == pytest.approx(0.03)
    assert remaining(wait, 0.16, head=0.0, last=0.10) == 0.0
    # A new arrival at 0.14 extends the window to 0.19.
    assert remaining(wait, 0.15, head=0.0, last=0.14) == pytest.approx(0.04)


def test_deadline_ends_the_wait_even_with_steady_arrivals() -> None:
    wait = AdmissionWait.from_ms(100)  # quiet window 20 ms
    assert remaining(wait, 0.095, head=0.0, last=0.094) == pytest.approx(0.005)
    assert remaining(wait, 0.100, head=0.0, last=0.099) == 0.0


def test_window_counts_from_the_oldest_arrival() -> None:
    # The head already waited 200 ms behind a running batch: it is not held again.
    assert remaining(AdmissionWait.from_ms(100), 0.3, head=0.1, last=0.3) == 0.0


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_negative_or_non_finite_wait_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="request_batch_max_wait_ms"):
        AdmissionWait.from_ms(bad)


def test_retry_after_is_the_work_ahead_over_the_concurrency() -> None:
    # 40 steps ahead, 3 s per step, 2 requests per step: 60 s until that work is done.
    assert retry_after_s(steps_ahead=40, step_s=3.0, concurrency=2.0) == pytest.approx(60.0)
    assert retry_after_s(steps_ahead=40, step_s=3.0, concurrency=4.0) == pytest.approx(30.0)


def test_retry_after_is_at_least_a_second_and_one_before_anything_was_timed() -> None:
    assert retry_after_s(steps_ahead=3, step_s=0.01, concurrency=8.0) == 1.0
    assert retry_after_s(steps_ahead=400, step_s=0.0, concurrency=0.0) == 1.0


def test_the_steps_a_request_runs_skip_what_its_strength_keeps() -> None:
    # Image-to-image at strength 0.5 redraws (and so denoises) half of its 20 steps.
    assert steps_to_run(SamplingParams(num_inference_steps=20, strength=0.5)) == 10
    assert steps_to_run(SamplingParams(num_inference_steps=20)) == 20
    assert steps_to_run(SamplingParams(num_inference_steps=3, strength=0.1)) == 1  # at least one
    assert steps_to_run(SamplingParams()) == 1
