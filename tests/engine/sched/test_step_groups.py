"""Deadline-aware step groups (`engine.sched.step_groups`): the pure rule, and the step scheduler
holding rows back with it, on a fake clock and fake learnt rates: no event loop, no torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import cast

from prometheus_client import CollectorRegistry

from engine.core.lane_counts import step_counter
from engine.core.lanes import Lane
from engine.request import BatchKey, GenerationRequest
from engine.sched.step_groups import Row, deadline_group
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from server.step_group_metrics import StepGroupCollector
from tests.engine.fakes import make_request

# One cost-step takes 0.01 s: a step of cost c takes c/100 s.
RATE = 0.01


def row(request_id: str, priority: int, steps: int, deadline: float | None = None, cost: int = 10) -> Row:
    # Rank as `engine.sched.priority.rank` with arrival 0 and aging 100 s: priority x 100.
    return Row(request_id, priority, priority * 100.0, cost, steps, deadline)


def test_batch_rows_join_only_while_the_urgent_request_stays_on_track() -> None:
    # The urgent request has 4 steps left and 2.0 s: alone a step takes 0.1 s (4 x 0.1 x 1.2
    # = 0.48 s); with k batch rows (k + 1) x 0.1 s. On track while 4 x 0.1 x (k+1) x 1.2 <= 2.0:
    # k + 1 <= 4.16, so three batch rows join and the other two are held back.
    rows = [row("urgent", 0, 4, deadline=2.0), *(row(f"batch{i}", 10, 32) for i in range(5))]
    assert deadline_group(rows, RATE, now=0.0) == ["urgent", "batch0", "batch1", "batch2"]
    # Later, with slack (nearly done), everyone steps again.
    rows[0] = row("urgent", 0, 1, deadline=2.0)
    assert deadline_group(rows, RATE, now=0.0) == [r.request_id for r in rows]


def test_nothing_learnt_no_deadline_or_one_priority_keep_todays_group() -> None:
    tight = [row("urgent", 0, 8, deadline=0.5), row("batch", 10, 32)]
    assert deadline_group(tight, None, now=0.0) == ["urgent", "batch"]
    no_deadline = [row("a", 0, 8), row("b", 10, 32)]
    assert deadline_group(no_deadline, RATE, now=0.0) == ["a", "b"]
    one_priority = [row("a", 5, 8, deadline=0.5), row("b", 5, 32), row("c", 5, 32, deadline=0.1)]
    assert deadline_group(one_priority, RATE, now=0.0) == ["a", "b", "c"]


def test_rows_of_the_urgent_priority_or_better_are_never_held_back() -> None:
    # Only worse priorities wait for it. Its step with the three takes 0.3 s (8 x 0.3 x 1.2 =
    # 2.88 s of 3.0 s: on track), with "worse" too 0.4 s (3.84 s: late).
    rows = [row("urgent", 3, 8, deadline=3.0), row("peer", 3, 32), row("better", 1, 32), row("worse", 4, 32)]
    assert deadline_group(rows, RATE, now=0.0) == ["urgent", "peer", "better"]


def test_a_request_past_saving_holds_nobody_back() -> None:
    # Alone it would already be late: holding batch rows back would only cost their throughput.
    rows = [row("late", 0, 8, deadline=0.5), row("batch", 10, 32)]
    assert deadline_group(rows, RATE, now=0.0) == ["late", "batch"]
    assert deadline_group([row("past", 0, 1, deadline=1.0), row("batch", 10, 32)], RATE, now=2.0) == [
        "past",
        "batch",
    ]


def test_an_aged_row_is_not_held_back() -> None:
    # Aging made the batch row's rank earlier than the urgent one's: it is not outranked.
    aged = Row("aged", 10, -1.0, 10, 32, None)
    assert deadline_group([row("urgent", 0, 4, deadline=0.6), aged], RATE, now=0.0) == ["urgent", "aged"]


def test_a_smaller_row_may_join_where_a_larger_one_did_not() -> None:
    rows = [row("urgent", 0, 4, deadline=1.0), row("big", 10, 32, cost=20), row("small", 10, 32, cost=5)]
    # 4 x 0.01 x 1.2 x cost <= 1.0: cost <= 20.8, so 10 + 5 fits, 10 + 20 does not.
    assert deadline_group(rows, RATE, now=0.0) == ["urgent", "small"]


@dataclass
class FakePace:
    """Learnt rates (a step takes the rate x the group's cost) and a clock set by hand; steps
    left counted down as plans step."""

    rates: dict[BatchKey, float] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)
    clock: float = 0.0

    def step_s(self, key: BatchKey, cost: int) -> float | None:
        rate = self.rates.get(key)
        return None if rate is None else rate * cost

    def steps_left(self, request_id: str) -> int | None:
        return self.left.get(request_id)

    def now(self) -> float:
        return self.clock


def request(request_id: str, priority: int, steps: int, deadline: float | None = None) -> GenerationRequest:
    made = make_request(request_id, steps=steps)
    return replace(made, params=replace(made.params, priority=priority), deadline=deadline)


def plan_of(scheduler: StepScheduler) -> StepPlan:
    plan = scheduler.schedule()
    assert plan is not None
    return plan


def test_the_scheduler_holds_batch_rows_back_until_the_urgent_request_is_done() -> None:
    pace = FakePace()
    scheduler = StepScheduler(max_num_seqs=8, aging_s=100.0, pace=pace)
    for i in range(3):
        scheduler.add(request(f"batch{i}", 10, 32), ("a",), cost=10)
    # Nothing learnt yet: today's group.
    assert plan_of(scheduler).step == ("batch0", "batch1", "batch2")
    pace.rates[("a",)] = RATE
    scheduler.add(request("urgent", 0, 4, deadline=1.0), ("a",), cost=10)
    # 4 steps x 0.01 x 1.2 x cost <= 1.0: cost <= 20.8, so one batch row steps beside it.
    plan = plan_of(scheduler)
    assert plan.step == ("urgent", "batch0") and [r.request_id for r in plan.join] == ["urgent"]
    assert scheduler.held_back_row_steps == 2
    # Held back, not paused or dropped: still running, their state kept for the next steps.
    assert (scheduler.num_running, scheduler.num_paused, plan.drop) == (4, 0, ())
    # With one step left it has slack: everyone steps.
    pace.left["urgent"] = 1
    assert plan_of(scheduler).step == ("urgent", "batch0", "batch1", "batch2")
    scheduler.finish(["urgent"])
    assert plan_of(scheduler).step == ("batch0", "batch1", "batch2")
    assert scheduler.held_back_row_steps == 2


def test_without_pace_the_scheduler_groups_as_before() -> None:
    scheduler = StepScheduler(max_num_seqs=8, aging_s=100.0)
    scheduler.add(request("batch", 10, 32), ("a",), cost=10)
    scheduler.add(request("urgent", 0, 4, deadline=0.01), ("a",), cost=10)
    assert plan_of(scheduler).step == ("urgent", "batch")
    assert scheduler.held_back_row_steps == 0


def test_held_back_row_steps_are_counted_in_metrics() -> None:
    scheduler = StepScheduler(max_num_seqs=8, aging_s=100.0)
    scheduler.held_back_row_steps = 3
    lanes = cast(list[Lane], [SimpleNamespace(steps=scheduler), SimpleNamespace(steps=None)])
    engine = SimpleNamespace(step_counter=functools.partial(step_counter, lanes))
    registry = CollectorRegistry()
    registry.register(StepGroupCollector(engine))
    assert registry.get_sample_value("diffbatch_held_back_row_steps_total") == 3.0


def test_a_row_held_back_since_it_joined_may_be_paused_for_a_better_newcomer() -> None:
    pace = FakePace(rates={("a",): RATE})
    scheduler = StepScheduler(max_num_seqs=2, aging_s=100.0, pace=pace)
    scheduler.add(request("urgent", 0, 8, deadline=1.0), ("a",), cost=10)
    scheduler.add(request("batch", 10, 32), ("a",), cost=10)
    # 8 x 0.01 x 1.2 x 20 = 1.92 s > 1.0 s: the batch row is held back from its first step.
    assert plan_of(scheduler).step == ("urgent",)
    scheduler.add(request("newcomer", 0, 4, deadline=1.0), ("a",), cost=10)
    plan = plan_of(scheduler)
    assert [r.request_id for r in plan.join] == ["newcomer"] and scheduler.is_paused("batch")
    assert plan.step == ("urgent", "newcomer")


def test_a_groups_step_time_may_grow_less_than_its_cost() -> None:
    # A step takes 1 s + 0.1 s a row: an urgent 4-step request due in 6 s keeps 2 batch rows
    # beside it (1.3 s a step, x HEADROOM x 4 = 6.24 s: no; 1 row: 1.2 x 1.2 x 4 = 5.76 s).
    rows = [row("urgent", 0, 4, 6.0, cost=1), row("batch0", 10, 32, cost=1), row("batch1", 10, 32, cost=1)]
    assert deadline_group(rows, lambda cost: 1.0 + 0.1 * cost, now=0.0) == ["urgent", "batch0"]
    # In proportion (1.1 s a row, the same step alone), both are held back.
    assert deadline_group(rows, 1.1, now=0.0) == ["urgent"]
