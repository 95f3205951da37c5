"""A request passing a paused one that cannot join (`engine.sched.passing`), alone and in the step
scheduler, on a fake clock (arrival times built by hand, one step per plan)."""

from __future__ import annotations

from engine.request import GenerationRequest
from engine.sched.passing import joiners, may_pass
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from tests.engine.sched.test_fair_preemption import heavy_running, sent
from tests.engine.sched.test_step_scheduler_preemption import prioritized


def plan_of(scheduler: StepScheduler) -> StepPlan:
    plan = scheduler.schedule()
    assert plan is not None
    return plan


def test_joiners_pass_only_a_paused_item_and_only_when_entitled() -> None:
    order = ["P", "a", "b", "W", "c"]
    joinable = {"a", "b", "c"}
    entitled = {("a", "P"), ("c", "P")}

    def run(paused: set[str]) -> list[str]:
        return list(
            joiners(order, joinable.__contains__, paused.__contains__, lambda x, held: (x, held) in entitled)
        )

    # P cannot join: "a" passes it, "b" may not, so admission stops there (strict order).
    assert run({"P"}) == ["a"]
    # A waiting item that cannot join stops admission, whatever comes after it.
    assert run(set()) == []
    entitled.add(("b", "P"))
    # "W" (waiting, cannot join) still stops it: "c" never passes a waiting request.
    assert run({"P"}) == ["a", "b"]


def test_a_sender_passes_only_while_it_would_hold_no_more_than_the_paused_ones() -> None:
    # As fair preemption's floor: what the newcomer adds counts, not only what its sender
    # holds already (light 1 seat of 4 beside heavy's 2: a 1-seat request may pass, a
    # 2-seat one would leave light holding 3 to heavy's 2).
    light, heavy = sent("l", "light", 2.0), sent("h", "heavy", 1.0)
    held = {"light": 0.25, "heavy": 0.5}

    def held_by(request: GenerationRequest) -> float:
        return held[request.tenant]

    assert may_pass(light, heavy, held_by, aging_s=10.0, joining=0.25)
    assert not may_pass(light, heavy, held_by, aging_s=10.0, joining=0.5)
    # A request of a higher priority passes whatever its sender holds.
    urgent = sent("u", "light", 2.0, priority=-1)
    assert may_pass(urgent, heavy, held_by, aging_s=10.0, joining=0.5)


def test_a_light_request_passes_the_heavy_tenants_paused_request() -> None:
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler)
    scheduler.add(sent("l0", "light", 5.0), ("a",))
    plan_of(scheduler)
    assert scheduler.is_paused("h3")  # light 1 seat, heavy 3
    # h3 comes first in the join order but cannot join; l1 may pass it and pause h2
    # (light would hold 2 seats, heavy 2: no overshoot).
    scheduler.add(sent("l1", "light", 6.0), ("a",))
    assert scheduler.can_admit()
    plan = plan_of(scheduler)
    assert [r.request_id for r in plan.join] == ["l1"]
    assert scheduler.is_paused("h2") and scheduler.is_paused("h3")
    # Light now holds its share: a third light request may not pass the paused ones.
    scheduler.add(sent("l2", "light", 7.0), ("a",))
    assert not scheduler.can_admit()
    assert plan_of(scheduler).join == () and scheduler.num_waiting == 1


def test_a_request_of_the_paused_ones_own_sender_never_passes_it() -> None:
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler)
    scheduler.add(sent("l0", "light", 5.0), ("a",))
    plan_of(scheduler)
    scheduler.add(sent("h4", "heavy", 6.0), ("a",))
    assert not scheduler.can_admit()
    # A seat frees: the paused heavy request takes it, before the later heavy one.
    scheduler.finish(["h0"])
    plan = plan_of(scheduler)
    assert plan.join == () and "h3" in plan.step and scheduler.num_waiting == 1


def test_a_stream_of_light_requests_never_starves_a_paused_heavy_one() -> None:
    # Light requests arrive one per step, forever; each runs 2 steps. The paused heavy
    # requests resume as soon as light holds its share, so each finishes in bounded time.
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler, steps=8)
    done_steps: dict[str, int] = {}
    steps_of = {f"h{i}": 8 for i in range(4)}
    finished: dict[str, int] = {}
    for tick in range(200):
        scheduler.add(sent(f"l{tick}", "light", 5.0 + tick, steps=2), ("a",))
        steps_of[f"l{tick}"] = 2
        plan = plan_of(scheduler)
        ended = []
        for request_id in plan.step:
            done_steps[request_id] = done_steps.get(request_id, 0) + 1
            if done_steps[request_id] == steps_of[request_id]:
                ended.append(request_id)
        for request_id in scheduler.finish(ended):
            finished[request_id] = tick
    assert all(f"h{i}" in finished for i in range(4)), finished
    assert max(finished[f"h{i}"] for i in range(4)) < 60


def test_a_paused_request_that_needs_more_seats_is_not_passed_past_its_aging_bound() -> None:
    # A priority-10 request of 2 images, paused for priority-0 work that then arrives one a
    # step, forever, 1 image and 2 steps each: a seat frees every step, never two at once.
    # Past its aging bound (10 levels x 1 s) the newcomers no longer outrank it, so none may
    # pass it: admission stops at it until both seats are free, and it runs.
    scheduler = StepScheduler(max_num_seqs=2, aging_s=1.0)
    scheduler.add(prioritized("big", 10, 0.0, n=2, steps=8), ("a",))
    plan_of(scheduler)
    steps_of, done, finished = {"big": 8}, {"big": 1}, {}
    for tick in range(1, 100):
        scheduler.add(prioritized(f"i{tick}", 0, float(tick), steps=2), ("a",))
        steps_of[f"i{tick}"] = 2
        plan = plan_of(scheduler)
        for request_id in plan.step:
            done[request_id] = done.get(request_id, 0) + 1
        for request_id in scheduler.finish([r for r in plan.step if done[r] == steps_of[r]]):
            finished[request_id] = tick
    assert scheduler.preemptions >= 1
    # Its bound: arrivals after t = 10 wait for it; then two steps for seats, 7 of its own.
    assert "big" in finished and finished["big"] <= 10 + 2 + 7 + 2
