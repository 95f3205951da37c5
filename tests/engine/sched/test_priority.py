"""Priority policy in both schedulers, on a fake clock (arrival times built by hand): no
event loop, no torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.core.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.request import MAX_PRIORITY, MIN_PRIORITY, GenerationRequest, SamplingParams
from engine.sched.priority import by_priority, rank
from engine.sched.scheduler import Scheduler
from engine.sched.step_scheduler import StepScheduler
from tests.engine.fakes import make_request


def prioritized(request_id: str, priority: int, arrival: float = 0.0, **kwargs: object) -> GenerationRequest:
    request = make_request(request_id, arrival=arrival, **kwargs)  # type: ignore[arg-type]
    return replace(request, params=replace(request.params, priority=priority))


def test_lower_priority_runs_first_then_the_older() -> None:
    requests = [prioritized("late-low", 5, 0.0), prioritized("high", 0, 1.0), prioritized("high-2", 0, 2.0)]
    order = by_priority(requests, lambda r: r, aging_s=10.0)
    assert [r.request_id for r in order] == ["high", "high-2", "late-low"]


def test_one_shared_priority_keeps_the_given_order() -> None:
    # Even arrival times out of order: with one priority the schedulers' own order stands.
    requests = [prioritized("b", 3, 5.0), prioritized("a", 3, 1.0)]
    assert [r.request_id for r in by_priority(requests, lambda r: r, aging_s=1.0)] == ["b", "a"]


def test_waiting_improves_priority_one_level_per_aging_period() -> None:
    old_low = prioritized("old-low", 3, 0.0)
    # Arriving under 3 aging periods after it, priority 0 goes first; later, it waits.
    assert rank(prioritized("x", 0, 2.9), aging_s=1.0) < rank(old_low, aging_s=1.0)
    assert rank(prioritized("x", 0, 3.1), aging_s=1.0) > rank(old_low, aging_s=1.0)


@pytest.mark.parametrize("priority", [MIN_PRIORITY - 1, MAX_PRIORITY + 1, 1.5, True])
def test_priority_out_of_range_is_refused_naming_it(priority: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(priority=priority)  # type: ignore[arg-type]
    assert caught.value.param == "priority"


@pytest.mark.parametrize("aging_s", [0.0, -1.0, float("inf")])
def test_aging_must_be_positive(aging_s: float) -> None:
    with pytest.raises(ValueError, match="aging"):
        EngineConfig(priority_aging_s=aging_s)
    with pytest.raises(ValueError, match="aging"):
        Scheduler(max_num_seqs=1, aging_s=aging_s)


def test_request_mode_a_later_high_priority_request_leads_the_next_batch() -> None:
    scheduler = Scheduler(max_num_seqs=2, aging_s=10.0)
    scheduler.add(prioritized("low", 10, 0.0, size=64), ("64",))
    scheduler.add(prioritized("high", 0, 1.0, size=128), ("128",))
    scheduler.add(prioritized("high-64", 0, 2.0, size=64), ("64",))
    scheduler.add(prioritized("mid-64", 1, 3.0, size=64), ("64",))
    assert scheduler.head_arrival() == 1.0
    batch = scheduler.next_batch()
    assert batch is not None and batch.request_ids == ["high"]
    # Same key: the batch takes the better priorities first, up to max_num_seqs.
    batch = scheduler.next_batch()
    assert batch is not None and batch.request_ids == ["high-64", "mid-64"]
    batch = scheduler.next_batch()
    assert batch is not None and batch.request_ids == ["low"]


def test_step_mode_high_priority_joins_first_and_chooses_the_step_key() -> None:
    scheduler = StepScheduler(max_num_seqs=2, aging_s=10.0)
    scheduler.add(prioritized("low", 10, 0.0), ("a",))
    scheduler.add(prioritized("low-2", 10, 0.5), ("a",))
    scheduler.add(prioritized("high", 0, 1.0), ("b",))
    assert scheduler.can_admit()
    plan = scheduler.schedule()
    assert plan is not None
    assert [r.request_id for r in plan.join] == ["high", "low"]  # low-2 does not fit
    assert plan.step == ("high",) and plan.key == ("b",)
    scheduler.finish(["high"])
    plan = scheduler.schedule()
    assert plan is not None and [r.request_id for r in plan.join] == ["low-2"]
    assert plan.step == ("low", "low-2")


def test_step_mode_a_newcomer_of_higher_priority_takes_the_next_step() -> None:
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    scheduler.add(prioritized("batch-job", 10, 0.0), ("a",))
    scheduler.schedule()
    scheduler.add(prioritized("interactive", 0, 5.0), ("b",))
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("interactive",)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_stream_of_urgent_work_never_holds_a_low_priority_request_past_its_aging_bound(mode: str) -> None:
    aging_s, tick = 1.0, 0.25
    low = prioritized("low", 10, 0.0, size=32)
    request_mode = Scheduler(max_num_seqs=1, aging_s=aging_s)
    step_mode = StepScheduler(max_num_seqs=1, aging_s=aging_s)
    served_at: float | None = None
    now = 0.0
    (request_mode.add if mode == "request" else step_mode.add)(low, ("low",))
    for i in range(200):  # a new priority-0 request every tick, one served per tick
        now = i * tick
        urgent = prioritized(f"u{i}", 0, now)
        if mode == "request":
            request_mode.add(urgent, ("u",))
            batch = request_mode.next_batch()
            assert batch is not None
            served = batch.request_ids
            request_mode.finish(batch)
        else:
            step_mode.add(urgent, ("u",))
            plan = step_mode.schedule()
            assert plan is not None
            served = list(plan.step)
            step_mode.finish(served)
        if "low" in served:
            served_at = now
            break
    # Passed over only by work that arrived within 10 levels x aging_s of it.
    assert served_at is not None
    assert 10 * aging_s - tick <= served_at <= 10 * aging_s + tick
