"""Step mode's deadline estimate (`engine.sched.step_admission`) and the group step times it uses
(`engine.sched.group_times`), as arithmetic on a fake clock: step times and rows built by hand."""

from __future__ import annotations

import pytest

from engine.outputs import ForwardRecord
from engine.sched.deadline_admission import HEADROOM, HeldWork, Work
from engine.sched.group_times import GroupTimes, line_time
from engine.sched.step_admission import Row, StepTime, step_estimate

KEY = ("a",)


def affine(base: float, per_cost: float) -> StepTime:
    """A device where a group's step takes `base + per_cost x cost` whatever the key."""
    return lambda key, cost: base + per_cost * cost


def test_a_newcomer_with_a_free_seat_steps_beside_the_running_rows_not_after_them() -> None:
    # One step: 1 s + 0.1 s per cost unit. A 32-step row runs; a 4-step newcomer joins it.
    ahead = [Row(KEY, 1, 1, 32)]
    found = step_estimate(ahead, Row(KEY, 1, 1, 4), affine(1.0, 0.1), max_num_seqs=8)
    assert found is not None
    # 4 group steps of 2 rows (1.2 s each), not 32 + 4 steps one after another.
    assert found.finish_s == pytest.approx(HEADROOM * 4 * 1.2)
    assert found.own_s == pytest.approx(HEADROOM * 4 * 1.1)


def test_without_a_seat_it_waits_for_the_shortest_row_ahead_to_end() -> None:
    ahead = [Row(KEY, 1, 1, 10), Row(KEY, 1, 1, 3)]
    found = step_estimate(ahead, Row(KEY, 1, 1, 4), affine(1.0, 0.0), max_num_seqs=2)
    assert found is not None
    # 3 steps until a seat frees, then 4 of its own beside the long row.
    assert found.finish_s == pytest.approx(HEADROOM * 7)
    # The step budget seats by cost as well: a cost-3 newcomer beside cost-2 rows, budget 4.
    budget = step_estimate(
        [Row(KEY, 2, 1, 10), Row(KEY, 2, 1, 3)],
        Row(KEY, 3, 1, 4),
        affine(1.0, 0.0),
        8,
        max_step_cost=4,
    )
    assert budget is not None and budget.finish_s == pytest.approx(HEADROOM * 14)


def test_rows_of_another_key_step_on_their_own() -> None:
    # The first seated row's key steps; the newcomer's key waits until that row is done.
    ahead = [Row(("video",), 1, 1, 5)]
    found = step_estimate(ahead, Row(KEY, 1, 1, 2), affine(1.0, 0.0), max_num_seqs=8)
    assert found is not None and found.finish_s == pytest.approx(HEADROOM * 7)


def test_nothing_measured_admits() -> None:
    assert step_estimate([], Row(KEY, 1, 1, 4), lambda key, cost: None, 8) is None


def test_group_times_fit_a_line_and_grow_in_proportion_past_the_largest_group() -> None:
    times = GroupTimes()
    assert times.step_s(KEY, 1) is None
    times.learn(KEY, 2, 1.0)
    # One cost measured: every other in proportion (below it a lower bound, so a lone request
    # is not refused for good on a full group's time).
    assert times.step_s(KEY, 1) == pytest.approx(0.5) and times.step_s(KEY, 4) == pytest.approx(2.0)
    times.learn(KEY, 4, 1.4)
    times.learn(KEY, 8, 2.2)
    # Through (2, 1.0), (4, 1.4), (8, 2.2): 0.6 s + 0.2 s per cost unit.
    assert times.step_s(KEY, 1) == pytest.approx(0.8)
    assert times.step_s(KEY, 6) == pytest.approx(1.8)
    assert times.step_s(KEY, 16) == pytest.approx(4.4)  # no batching gain past what was seen
    assert times.step_s(("other",), 1) is None


def test_the_fit_never_goes_below_zero() -> None:
    # A negative slope (noise) gives the mean; a negative base a line through zero.
    assert line_time([(1, 2.0), (2, 1.0)], 1) == pytest.approx(1.5)
    assert line_time([(2, 1.0), (4, 3.0)], 1) == pytest.approx(0.7)


def test_held_work_learns_a_groups_step_time_from_its_rows_costs() -> None:
    held = HeldWork()
    for name in ("r1", "r2"):
        held.hold(name, Work(KEY, 4, 10))
    record = ForwardRecord(num_requests=2, num_images=2, seconds=0.0, ok=True)
    held.learn(KEY, ["r1", "r2"], 2, [record], seconds=99.0, finished=True)  # the warm-up
    assert held.step_s(KEY, 8) is None
    held.learn(KEY, ["r1", "r2"], 2, [record], seconds=1.6)
    assert held.groups.step_s(KEY, 8) == pytest.approx(1.6)
    assert held.step_s(KEY, 8) == pytest.approx(1.6)
    # A key with no group measured: the seconds per cost-step times the cost.
    assert held.step_s(("b",), 4) == pytest.approx(0.8)


def test_a_unit_of_several_group_steps_teaches_the_time_of_one() -> None:
    held = HeldWork()
    for name in ("r1", "r2"):
        held.hold(name, Work(KEY, 4, 10))
    record = ForwardRecord(num_requests=2, num_images=2, seconds=0.0, ok=True)
    held.learn(KEY, ["r1", "r2"], 2, [record], seconds=99.0, finished=True)  # the warm-up
    # Three steps of the pair, the second split in halves (out of memory): 3 group steps.
    half = ForwardRecord(num_requests=1, num_images=1, seconds=0.0, ok=True)
    held.learn(KEY, ["r1", "r2"], 2, [record, half, half, record], seconds=3.0)
    assert held.groups.step_s(KEY, 8) == pytest.approx(1.0)
