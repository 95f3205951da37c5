"""The deadline estimate and refusal, as arithmetic on a fake clock (units of work, their
times and the time left built by hand): no event loop, no torch."""

from __future__ import annotations

import pickle

import pytest

from engine.errors import DeadlineUnmeetableError
from engine.outputs import ForwardRecord
from engine.sched.deadline_admission import HEADROOM, Estimate, HeldWork, StepRates, Work, estimate, refusal


def forward(images: int = 1, steps: int = 1, *, ok: bool = True, interrupted: bool = False) -> ForwardRecord:
    """A forward's record; its own `seconds` are not read (the unit's wall time is)."""
    return ForwardRecord(
        num_requests=images, num_images=images, seconds=0.0, ok=ok, steps=steps, interrupted=interrupted
    )


def warm_rates() -> StepRates:
    """Rates past the warm-up (which ends with a first finished request, teaching nothing)."""
    rates = StepRates()
    rates.learn(("warm-up",), [forward()], 1, seconds=1000.0, finished=True)
    assert rates.rate(("warm-up",)) is None
    return rates


def test_nothing_is_learnt_until_a_first_request_is_done() -> None:
    rates = StepRates()
    rates.learn(("a",), [forward()], 1, seconds=50.0)  # its first steps
    rates.learn(("a",), [], 0.0, seconds=50.0, finished=True)  # its first decode
    assert rates.rate(("a",)) is None
    rates.learn(("a",), [forward()], 1, seconds=1.0)
    assert rates.rate(("a",)) == pytest.approx(1.0)  # none of the warm-up's time carried


def test_nothing_measured_admits() -> None:
    assert estimate([Work(("a",), 10, 1000)], Work(("a",), 10, 4), StepRates()) is None
    assert refusal(None, time_left_s=0.001) is None


def test_a_units_time_is_spread_over_the_cost_steps_of_its_forwards() -> None:
    rates = warm_rates()
    # 2 images of cost 5 each, 4 steps, in 8 s: 8 / (4 x 2 x 5) = 0.2 s per cost-step.
    rates.learn(("a",), [forward(images=2, steps=4)], cost_per_image=5, seconds=8.0)
    assert rates.rate(("a",)) == pytest.approx(0.2)
    # A key not seen yet takes every key's rate (cost-normalised).
    assert rates.rate(("b",)) == pytest.approx(0.2)


def test_a_unit_that_steps_nothing_passes_its_time_to_the_next() -> None:
    rates = warm_rates()
    rates.learn(("a",), [], 0.0, seconds=3.0)  # a decode, say
    assert rates.rate(("a",)) is None
    rates.learn(("a",), [forward()], 1, seconds=1.0)
    assert rates.rate(("a",)) == pytest.approx(4.0)


def test_failed_or_cut_short_units_teach_nothing() -> None:
    rates = warm_rates()
    rates.learn(("a",), [forward(ok=False)], 1, seconds=99.0)
    rates.learn(("a",), [forward(), forward(interrupted=True)], 1, seconds=99.0)
    assert rates.rate(("a",)) is None


def test_the_rate_is_a_running_mean_per_key() -> None:
    rates = warm_rates()
    rates.learn(("a",), [forward()], 1, seconds=1.0)
    rates.learn(("a",), [forward()], 1, seconds=2.0)
    assert rates.rate(("a",)) == pytest.approx(1.2)  # weight 0.2 on the newest
    rates.learn(("b",), [forward()], 1, seconds=10.0)
    assert rates.rate(("a",)) == pytest.approx(1.2)  # each key its own


def test_the_finish_is_the_work_ahead_over_the_workers_plus_the_own_work() -> None:
    rates = warm_rates()
    rates.learn(("a",), [forward()], 1, seconds=0.5)  # 0.5 s per cost-step
    rates.learn(("b",), [forward()], 1, seconds=2.0)  # 2 s per cost-step
    ahead = [Work(("a",), 2, 10), Work(("b",), 1, 5)]  # 10 s + 10 s
    found = estimate(ahead, Work(("a",), 1, 4), rates, workers=2)
    assert found is not None
    # With headroom for what the estimate does not see (the HTTP side, other processes).
    assert found.ahead_s == pytest.approx(10.0 * HEADROOM) and found.own_s == pytest.approx(2.0 * HEADROOM)


def test_refused_when_the_finish_is_past_the_deadline_retry_after_the_excess() -> None:
    found = Estimate(ahead_s=20.0, own_s=2.0)
    assert refusal(found, time_left_s=22.0) is None  # just in time
    error = refusal(found, time_left_s=5.0)
    assert isinstance(error, DeadlineUnmeetableError)
    assert error.retry_after_s == pytest.approx(17.0) and error.retry
    message = str(error)
    assert "finish in about 22.0 s" in message and "deadline is in 5.0 s" in message
    assert "20.0 s of work ahead" in message


def test_a_request_too_long_even_alone_is_told_a_retry_will_not_help() -> None:
    error = refusal(Estimate(ahead_s=3.0, own_s=10.0), time_left_s=5.0)
    assert error is not None and not error.retry and error.retry_after_s == 3.0
    assert "even alone" in str(error)
    again = pickle.loads(pickle.dumps(error))  # a Ray Serve replica's answer crosses processes
    assert (str(again), again.retry_after_s, again.retry) == (str(error), 3.0, False)


def test_held_work_counts_the_steps_left_and_learns_from_its_requests_costs() -> None:
    held = HeldWork()
    held.hold("r1", Work(("a",), 4, 10))
    held.hold("r2", Work(("a",), 4, 10))
    held.progress("r1", 6)
    assert held.left("r1") == Work(("a",), 4, 4)
    held.learn(("a",), ["r1", "r2"], 2, [forward(images=2)], seconds=99.0, finished=True)  # the warm-up
    # r1 and r2 (2 images, cost 4 each) stepped once together in 1.6 s: 0.2 s per cost-step.
    held.learn(("a",), ["r1", "r2"], 2, [forward(images=2)], seconds=1.6)
    assert held.rates.rate(("a",)) == pytest.approx(0.2)
    held.release("r1")
    assert held.left("r1") is None
