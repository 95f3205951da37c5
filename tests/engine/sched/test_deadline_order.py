"""Earliest deadline first among equals, in both schedulers, on a fake clock (arrival times
and deadlines built by hand): no event loop, no torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.request import GenerationRequest
from engine.sched.priority import by_priority
from engine.sched.scheduler import Scheduler
from engine.sched.step_scheduler import StepScheduler
from tests.engine.fakes import make_request


def due(request_id: str, arrival: float, deadline: float | None, priority: int = 0) -> GenerationRequest:
    request = make_request(request_id, arrival=arrival)
    return replace(request, deadline=deadline, params=replace(request.params, priority=priority))


def ids(requests: list[GenerationRequest]) -> list[str]:
    return [r.request_id for r in requests]


def test_among_one_priority_the_earlier_deadline_goes_first_and_no_deadline_last() -> None:
    requests = [due("none", 0.0, None), due("late", 1.0, 600.0), due("soon", 2.0, 7.0)]
    assert ids(by_priority(requests, lambda r: r, aging_s=2.0)) == ["soon", "late", "none"]


def test_without_deadlines_or_with_one_shared_timeout_the_order_is_unchanged() -> None:
    # The schedulers' own order stands, even out of arrival order (as without deadlines).
    undated = [due("b", 5.0, None), due("a", 1.0, None), due("c", 3.0, None)]
    assert ids(by_priority(undated, lambda r: r, aging_s=2.0)) == ["b", "a", "c"]
    # One shared timeout: deadline order is arrival order.
    shared = [due(f"r{i}", float(i), i + 600.0, priority=i % 2) for i in range(6)]
    assert ids(by_priority(shared, lambda r: r, aging_s=2.0)) == ids(
        by_priority([replace(r, deadline=None) for r in shared], lambda r: r, aging_s=2.0)
    )


def test_deadlines_never_move_work_across_priorities() -> None:
    # The priority-0 places (first and third) stay priority 0's; deadlines only pick who
    # of priority 0 takes them.
    requests = [
        due("p0-late", 0.0, 900.0, priority=0),
        due("p1-soon", 1.0, 2.0, priority=1),
        due("p0-soon", 3.0, 10.0, priority=0),
    ]
    assert ids(by_priority(requests, lambda r: r, aging_s=2.0)) == ["p0-soon", "p1-soon", "p0-late"]


def test_request_mode_the_earlier_deadline_leads_the_batch() -> None:
    scheduler = Scheduler(max_num_seqs=1)
    scheduler.add(due("relaxed", 0.0, 600.0), ("a",))
    scheduler.add(due("urgent", 1.0, 5.0), ("b",))
    batch = scheduler.next_batch()
    assert batch is not None and batch.request_ids == ["urgent"]


def test_step_mode_the_earlier_deadline_joins_and_steps_first() -> None:
    scheduler = StepScheduler(max_num_seqs=1)
    scheduler.add(due("relaxed", 0.0, 600.0), ("a",))
    scheduler.add(due("urgent", 1.0, 5.0), ("b",))
    plan = scheduler.schedule()
    assert plan is not None and ids(list(plan.join)) == ["urgent"] and plan.step == ("urgent",)
    # Both running: the earlier deadline chooses the step key.
    wide = StepScheduler(max_num_seqs=2)
    wide.add(due("relaxed", 0.0, 600.0), ("a",))
    wide.add(due("urgent", 1.0, 5.0), ("b",))
    plan = wide.schedule()
    assert plan is not None and plan.key == ("b",) and plan.step == ("urgent",)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_work_ahead_of_a_newcomer_is_what_its_scheduler_serves_first(mode: str) -> None:
    """Admission by deadline counts the waiting requests the scheduler's own order (priority,
    deadline, fair share between keys) puts first, not every request queued earlier."""
    scheduler: Scheduler | StepScheduler = (
        Scheduler(max_num_seqs=1) if mode == "request" else StepScheduler(1)
    )
    for i in range(5):
        scheduler.add(replace(due(f"heavy{i}", float(i), 600.0 + i), tenant="heavy"), ("a",))

    def before(request: GenerationRequest) -> list[str]:
        if isinstance(scheduler, Scheduler):
            return ids(scheduler.waiting_before(request, ("a",)))
        return ids(scheduler.waiting_before(request, ("a",), 1))

    # The same key's next request waits behind all of them; a light key's waits one turn.
    assert before(replace(due("heavy5", 9.0, 609.0), tenant="heavy")) == [f"heavy{i}" for i in range(5)]
    assert before(replace(due("light", 9.0, 609.0), tenant="light")) == ["heavy0"]  # one turn
    # With one key, an earlier deadline goes first.
    assert before(replace(due("urgent", 9.0, 601.5), tenant="heavy")) == ["heavy0", "heavy1"]
