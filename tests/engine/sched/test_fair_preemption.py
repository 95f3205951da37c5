"""Preemption between tenants of one priority in the step scheduler (`engine.sched.preemption`'s
`fair_victims`), on a fake clock (arrival times built by hand, one step per plan): no event
loop, no torch."""

from __future__ import annotations

import re
from dataclasses import replace

from engine.request import GenerationRequest
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from tests.engine.fakes import make_request


def sent(
    request_id: str,
    tenant: str,
    arrival: float = 0.0,
    *,
    weight: float = 1.0,
    priority: int = 0,
    steps: int = 8,
    n: int = 1,
) -> GenerationRequest:
    request = make_request(request_id, arrival=arrival, steps=steps, n=n)
    params = replace(request.params, priority=priority)
    return replace(request, params=params, tenant=tenant, tenant_weight=weight)


def plan_of(scheduler: StepScheduler) -> StepPlan:
    plan = scheduler.schedule()
    assert plan is not None
    return plan


def heavy_running(scheduler: StepScheduler, count: int = 4, weight: float = 1.0, **kwargs: object) -> None:
    """`count` requests of tenant "heavy" join and take a step."""
    for i in range(count):
        scheduler.add(sent(f"h{i}", "heavy", float(i), weight=weight, **kwargs), ("a",))  # type: ignore[arg-type]
    assert len(plan_of(scheduler).step) == count


def test_a_light_tenant_pauses_the_over_served_tenants_latest_request() -> None:
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler)
    scheduler.add(sent("l0", "light", 5.0), ("a",))
    assert scheduler.can_admit()  # the engine interrupts the running steps for it
    plan = plan_of(scheduler)
    assert [r.request_id for r in plan.join] == ["l0"] and plan.drop == ()
    assert scheduler.is_paused("h3") and scheduler.preemptions == 1
    assert set(plan.step) == {"h0", "h1", "h2", "l0"}
    # Heavy now holds 3 of 4 seats, light 1: its paused request cannot take the seat back.
    assert not scheduler.can_admit()
    plan_of(scheduler)
    assert scheduler.is_paused("h3") and scheduler.preemptions == 1
    # It resumes, at its step, when a seat frees.
    scheduler.finish(["h0"])
    plan = plan_of(scheduler)
    assert plan.join == () and "h3" in plan.step and scheduler.num_paused == 0


def test_it_stops_at_the_fair_share_and_never_passes_requests_back_and_forth() -> None:
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler)
    for i in range(3):
        scheduler.add(sent(f"l{i}", "light", 5.0 + i), ("a",))
    for _ in range(6):
        plan_of(scheduler)
    # Two each: the third light request waits, as do the two paused heavy ones.
    assert scheduler.preemptions == 2 and scheduler.num_paused == 2
    assert scheduler.num_waiting == 1 and not scheduler.can_admit()


def test_it_never_takes_more_than_the_other_tenant_keeps() -> None:
    # One heavy video holds 80 of a 100 budget: pausing it for a 30 image would leave heavy
    # with less than light, and the video would then take its place back.
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=100, aging_s=10.0)
    scheduler.add(sent("video", "heavy"), ("a",), cost=80)
    plan_of(scheduler)
    scheduler.add(sent("image", "light", 1.0), ("a",), cost=30)
    assert not scheduler.can_admit()
    assert plan_of(scheduler).step == ("video",) and scheduler.num_paused == 0


def test_weights_set_the_share() -> None:
    # Weight 3 against 1: heavy's fair share of 4 seats is 3, so it gives one, then no more.
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler, weight=3.0)
    scheduler.add(sent("l0", "light", 5.0), ("a",))
    scheduler.add(sent("l1", "light", 6.0), ("a",))
    for _ in range(4):
        plan_of(scheduler)
    assert scheduler.preemptions == 1 and scheduler.num_waiting == 1


def test_with_one_tenant_or_no_keys_nothing_pauses() -> None:
    for tenant in ("", "heavy"):
        scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
        for i in range(4):
            scheduler.add(sent(f"h{i}", tenant, float(i)), ("a",))
        plan_of(scheduler)
        scheduler.add(sent("late", tenant, 5.0), ("a",))
        assert not scheduler.can_admit()
        assert len(plan_of(scheduler).step) == 4 and scheduler.num_paused == 0


def test_with_preemption_off_nothing_pauses() -> None:
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0, preemption=False)
    heavy_running(scheduler)
    scheduler.add(sent("l0", "light", 5.0), ("a",))
    assert not scheduler.can_admit()
    assert plan_of(scheduler).join == () and scheduler.num_paused == 0


def test_a_request_that_has_not_stepped_since_it_joined_is_not_paused() -> None:
    scheduler = StepScheduler(max_num_seqs=2, aging_s=10.0)
    scheduler.add(sent("h0", "heavy", 0.0), ("a",))
    scheduler.add(sent("h1", "heavy", 1.0), ("b",))  # another key: joins, does not step
    assert plan_of(scheduler).step == ("h0",)
    scheduler.add(sent("l0", "light", 5.0), ("a",))
    plan_of(scheduler)
    # h1 is the latest, but has not stepped: h0 pauses instead.
    assert scheduler.is_paused("h0") and not scheduler.is_paused("h1")


def test_it_never_crosses_priorities() -> None:
    # A worse-priority light request never pauses better-priority heavy ones, whatever the shares.
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler, priority=0)
    scheduler.add(sent("l0", "light", 5.0, priority=3), ("a",))
    assert not scheduler.can_admit()
    plan_of(scheduler)
    assert scheduler.num_paused == 0
    # Heavy's running work of another priority does not count against it either: a light
    # request of priority 3 beside heavy's three of priority 0 and one of priority 3 holds
    # its share of priority 3 once it has a seat, so it pauses nothing.
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    heavy_running(scheduler, count=3, priority=0)
    scheduler.add(sent("h-p3", "heavy", 3.0, priority=3), ("a",))
    scheduler.add(sent("l-p3", "light", 3.5, priority=3), ("a",))
    plan_of(scheduler)
    assert scheduler.num_waiting == 1
    scheduler.finish(["h0"])
    plan_of(scheduler)  # l-p3 joins the freed seat; heavy holds one of priority 3, light one
    scheduler.add(sent("l2-p3", "light", 4.0, priority=3), ("a",))
    plan_of(scheduler)
    assert scheduler.num_paused == 0


def test_a_light_trickle_beside_a_backlog_waits_at_most_one_step() -> None:
    """Heavy sends at the server's capacity (4 seats, 8 steps a request: one every other
    tick), light one request every 20 ticks. With fair preemption each light request steps
    in the tick it arrives, as if alone; without, it waits for a heavy request to finish.
    Nobody is paused twice without a step in between."""

    def light_latencies(preemption: bool) -> tuple[list[int], dict[str, str]]:
        scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0, preemption=preemption)
        arrivals: dict[int, list[GenerationRequest]] = {}
        for tick in range(0, 200, 2):
            arrivals.setdefault(tick, []).append(sent(f"h{tick}", "heavy", tick * 0.1))
        for tick in range(5, 200, 20):
            arrivals.setdefault(tick, []).append(sent(f"l{tick}", "light", tick * 0.1))
        steps: dict[str, int] = {}
        life: dict[str, str] = {}
        latency: list[int] = []
        for tick in range(240):
            for request in arrivals.get(tick, []):
                scheduler.add(request, ("a",))
                steps[request.request_id], life[request.request_id] = 0, ""
            plan = scheduler.schedule()
            step = plan.step if plan is not None else ()
            for request_id in step:
                steps[request_id] += 1
            for request_id in life:
                if scheduler.has_request(request_id):
                    paused = scheduler.is_paused(request_id)
                    life[request_id] += "R" if request_id in step else "P" if paused else "W"
            done = [rid for rid in step if steps[rid] == 8]
            for request_id in scheduler.finish(done):
                if request_id.startswith("l"):
                    latency.append(tick + 1 - int(request_id[1:]))
        return latency, life

    fair, life = light_latencies(preemption=True)
    assert len(fair) == 10 and max(fair) == 8, fair  # 8 steps, from the tick it arrived
    assert all(re.search("PW+P", lived) is None for lived in life.values())
    assert any("P" in lived for lived in life.values())
    without, _ = light_latencies(preemption=False)
    assert max(without) > 8, without


def test_an_even_split_is_reached_whatever_the_seat_count() -> None:
    # Footprints of 1/6, 1/7 ... do not add up exactly: a tie must still count as a tie.
    for seats in (2, 3, 6, 7, 10):
        scheduler = StepScheduler(max_num_seqs=seats, aging_s=10.0)
        heavy_running(scheduler, count=seats)
        for i in range(seats):
            scheduler.add(sent(f"l{i}", "light", 50.0 + i), ("a",))
        for _ in range(2 * seats):
            plan_of(scheduler)
        assert scheduler.preemptions == seats // 2, seats
