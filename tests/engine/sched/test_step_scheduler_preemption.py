"""Preemption at step boundaries in the step scheduler, on a fake clock (arrival times built
by hand, one step per plan): no event loop, no torch."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from engine.request import GenerationRequest
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from tests.engine.fakes import make_request


def prioritized(request_id: str, priority: int, arrival: float = 0.0, **kwargs: object) -> GenerationRequest:
    request = make_request(request_id, arrival=arrival, **kwargs)  # type: ignore[arg-type]
    return replace(request, params=replace(request.params, priority=priority))


def plan_of(scheduler: StepScheduler) -> StepPlan:
    plan = scheduler.schedule()
    assert plan is not None
    return plan


def joined(plan: StepPlan) -> list[str]:
    return [r.request_id for r in plan.join]


def test_a_better_request_that_does_not_fit_pauses_the_worst_running_one() -> None:
    scheduler = StepScheduler(max_num_seqs=2, aging_s=10.0)
    scheduler.add(prioritized("mid", 5, 0.0), ("a",), cost=10)
    scheduler.add(prioritized("low", 10, 0.0), ("a",), cost=20)
    assert plan_of(scheduler).step == ("mid", "low")
    scheduler.add(prioritized("urgent", 0, 1.0), ("a",), cost=30)
    assert scheduler.can_admit()  # the engine interrupts the running steps for it
    plan = plan_of(scheduler)
    # "low" leaves the running set but is not dropped: its state stays in the executor.
    assert joined(plan) == ["urgent"] and plan.step == ("urgent", "mid") and plan.drop == ()
    assert (scheduler.num_running, scheduler.num_paused, scheduler.preemptions) == (2, 1, 1)
    assert scheduler.is_paused("low") and scheduler.has_request("low")
    # Still held on this worker: routing counts it (it will need its room back).
    assert scheduler.held_cost == 60 and scheduler.num_held == 3 and ("a",) in scheduler.held_keys()
    scheduler.finish(["urgent"])
    # It resumes at the step it was at: it is not prepared again (not in `join`).
    plan = plan_of(scheduler)
    assert joined(plan) == [] and plan.step == ("mid", "low")
    assert scheduler.num_paused == 0


def test_a_paused_request_resumes_ahead_of_a_newcomer_of_its_own_rank() -> None:
    scheduler = StepScheduler(max_num_seqs=1, aging_s=10.0)
    scheduler.add(prioritized("low", 10, 0.0), ("a",))
    plan_of(scheduler)
    scheduler.add(prioritized("urgent", 0, 1.0), ("a",))
    assert plan_of(scheduler).step == ("urgent",)
    scheduler.add(prioritized("same-rank", 10, 0.0), ("a",))  # the same arrival and priority
    scheduler.finish(["urgent"])
    plan = plan_of(scheduler)
    assert plan.step == ("low",) and joined(plan) == []
    assert scheduler.num_waiting == 1


def test_equal_priorities_never_preempt() -> None:
    scheduler = StepScheduler(max_num_seqs=1, aging_s=10.0)
    # Running, though it arrived later (it was sent again after its worker died, say).
    scheduler.add(prioritized("running", 3, 5.0), ("a",))
    plan_of(scheduler)
    scheduler.add(prioritized("older", 3, 0.0), ("a",))
    assert not scheduler.can_admit()
    plan = plan_of(scheduler)
    assert plan.step == ("running",) and scheduler.num_paused == 0


def test_a_batch_job_that_has_aged_past_the_newcomer_is_not_paused() -> None:
    for arrival, pauses in [(15.0, True), (25.0, False)]:
        scheduler = StepScheduler(max_num_seqs=1, aging_s=2.0)
        scheduler.add(prioritized("batch", 10, 0.0), ("a",))  # rank 0 + 10 x 2 = 20
        plan_of(scheduler)
        scheduler.add(prioritized("interactive", 0, arrival), ("a",))
        plan = plan_of(scheduler)
        assert (scheduler.num_paused == 1) is pauses, arrival
        assert plan.step == (("interactive",) if pauses else ("batch",))


def test_only_as_many_as_needed_pause_worst_first_and_none_if_that_cannot_make_room() -> None:
    scheduler = StepScheduler(max_num_seqs=4, aging_s=10.0)
    for request_id, priority in [("p1", 1), ("p3", 3), ("p2", 2), ("p0", 0)]:
        scheduler.add(prioritized(request_id, priority, 0.0), ("a",))
    plan_of(scheduler)
    scheduler.add(prioritized("two-images", 1, 1.0, n=2), ("a",))
    plan = plan_of(scheduler)
    # It outranks p2 and p3 (not p1: the same priority), and needs two images.
    assert joined(plan) == ["two-images"] and scheduler.num_paused == 2
    assert set(plan.step) == {"p0", "p1", "two-images"}
    # Needing all four images, it could only get them from p0 and p1 too, which it does not
    # outrank: nobody pauses, admission waits.
    scheduler.add(prioritized("four-images", 1, 2.0, n=4), ("a",))
    plan = plan_of(scheduler)
    assert joined(plan) == [] and scheduler.num_paused == 2 and scheduler.preemptions == 2


def test_the_compute_budget_also_makes_room_by_pausing() -> None:
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=100, aging_s=10.0)
    scheduler.add(prioritized("video", 10, 0.0), ("a",), cost=80)
    plan_of(scheduler)
    scheduler.add(prioritized("image", 0, 1.0), ("a",), cost=30)
    plan = plan_of(scheduler)
    assert plan.step == ("image",) and scheduler.num_paused == 1


def test_a_request_pauses_only_after_it_stepped_since_it_joined_or_resumed() -> None:
    scheduler = StepScheduler(max_num_seqs=2, aging_s=10.0)
    scheduler.add(prioritized("mid", 5, 0.0), ("a",))
    scheduler.add(prioritized("low", 10, 0.0), ("b",))  # another key: joins, does not step
    assert plan_of(scheduler).step == ("mid",)
    scheduler.add(prioritized("urgent", 0, 1.0), ("a",))
    plan = plan_of(scheduler)
    # "low" is worse, but has not stepped since it joined: "mid" pauses instead.
    assert joined(plan) == ["urgent"] and plan.step == ("urgent",)
    assert scheduler.is_paused("mid") and not scheduler.is_paused("low")
    scheduler.finish(["urgent"])
    plan = plan_of(scheduler)
    assert plan.step == ("mid",) and not scheduler.is_paused("mid")  # resumed, and stepped
    scheduler.add(prioritized("urgent-2", 0, 2.0), ("a",))
    plan_of(scheduler)
    # "low" still has not stepped (its key waits for its turn); "mid" has, since it resumed.
    assert scheduler.is_paused("mid") and not scheduler.is_paused("low")
    assert scheduler.preemptions == 2


def test_an_aborted_paused_request_has_its_state_dropped_and_is_not_owed() -> None:
    scheduler = StepScheduler(max_num_seqs=1, aging_s=10.0)
    scheduler.add(prioritized("low", 10, 0.0), ("a",))
    plan_of(scheduler)
    scheduler.add(prioritized("urgent", 0, 1.0), ("a",))
    plan_of(scheduler)
    assert scheduler.abort("low") is False  # not waiting: it has a state to drop
    assert not scheduler.has_request("low") and scheduler.num_paused == 0
    assert plan_of(scheduler).drop == ("low",)
    assert scheduler.finish(["urgent", "low"]) == ["urgent"]


def test_a_paused_request_whose_worker_died_is_owed_its_error() -> None:
    scheduler = StepScheduler(max_num_seqs=1, aging_s=10.0)
    scheduler.add(prioritized("low", 10, 0.0), ("a",))
    plan_of(scheduler)
    scheduler.add(prioritized("urgent", 0, 1.0), ("a",))
    plan_of(scheduler)
    # The process executor fails every request its dead worker held, paused ones included.
    assert scheduler.finish(["urgent", "low"]) == ["urgent", "low"]
    assert not scheduler.has_work()


def test_with_preemption_off_nothing_pauses() -> None:
    scheduler = StepScheduler(max_num_seqs=1, aging_s=10.0, preemption=False)
    scheduler.add(prioritized("low", 10, 0.0), ("a",))
    plan_of(scheduler)
    scheduler.add(prioritized("urgent", 0, 1.0), ("a",))
    assert not scheduler.can_admit()
    assert plan_of(scheduler).step == ("low",) and scheduler.num_paused == 0


@dataclass
class Trace:
    """What a run of plans did to each request: steps taken, and its life as a string of
    R (ran a step), P (paused), W (waiting or running without stepping), one letter a plan."""

    steps: dict[str, int] = field(default_factory=dict)
    life: dict[str, str] = field(default_factory=dict)
    finished_at: dict[str, int] = field(default_factory=dict)


def simulate(scheduler: StepScheduler, arrivals: dict[int, list[GenerationRequest]], plans: int) -> Trace:
    """One plan per tick of the fake clock: arrivals of the tick join the queue, the plan's
    group takes one step, requests with all their steps done finish."""
    trace = Trace()
    totals: dict[str, int] = {}
    for tick in range(plans):
        for request in arrivals.get(tick, []):
            scheduler.add(request, ("a",))
            trace.steps[request.request_id] = 0
            trace.life[request.request_id] = ""
            totals[request.request_id] = request.params.num_inference_steps or 1
        plan = scheduler.schedule()
        step = plan.step if plan is not None else ()
        for request_id in trace.life:
            if request_id not in trace.finished_at:
                paused = scheduler.is_paused(request_id)
                trace.life[request_id] += "R" if request_id in step else "P" if paused else "W"
        for request_id in step:
            trace.steps[request_id] += 1
        done = [rid for rid in step if trace.steps[rid] == totals[rid]]
        for request_id in scheduler.finish(done):
            trace.finished_at[request_id] = tick
    return trace


def test_a_stream_of_short_urgent_requests_never_pauses_a_request_twice_without_a_step() -> None:
    """A priority-0 request every other tick (each 1 step) against a 12-step batch job on one
    seat: the job is paused for them, resumes between them, and every resume buys a step."""
    aging_s = 1.0
    arrivals = {0: [prioritized("job", 10, 0.0, steps=12)]}
    for tick in range(1, 60, 2):
        arrivals[tick] = [prioritized(f"u{tick}", 0, tick * 0.25, steps=1)]
    scheduler = StepScheduler(max_num_seqs=1, aging_s=aging_s)
    trace = simulate(scheduler, arrivals, plans=80)
    life = trace.life["job"]
    assert trace.steps["job"] == 12 and "job" in trace.finished_at
    assert life.startswith("RPRPRP")
    # Never resumed and paused again without a step in between.
    assert re.search("PW+P", life) is None
    assert scheduler.preemptions == 11
    # Urgent ones never wait behind the job: each ran in the tick it arrived (the job had
    # stepped, so it paused for them).
    for tick in range(1, 60, 2):
        assert trace.finished_at[f"u{tick}"] == tick


def test_urgent_work_arriving_past_the_aging_bound_no_longer_pauses_a_batch_job() -> None:
    """Aging bounds preemption as it bounds admission: a continuous stream of priority-0 work
    pauses a priority-10 job only while it arrives within 10 x aging_s of the job."""
    aging_s, tick_s = 1.0, 0.25
    arrivals = {0: [prioritized("job", 10, 0.0, steps=8)]}
    for tick in range(1, 200):
        arrivals[tick] = [prioritized(f"u{tick}", 0, tick * tick_s, steps=1)]
    scheduler = StepScheduler(max_num_seqs=1, aging_s=aging_s)
    trace = simulate(scheduler, arrivals, plans=200)
    # The job runs once the stream arrives later than its rank (10 x aging_s), then finishes
    # in its 8 steps without another pause.
    finished = trace.finished_at["job"]
    assert finished * tick_s <= 10 * aging_s + 8 * tick_s + tick_s
    last_pause = trace.life["job"].rfind("P")
    assert last_pause * tick_s <= 10 * aging_s + tick_s


def test_a_request_done_denoising_is_not_paused_it_only_waits_for_its_decode() -> None:
    scheduler = StepScheduler(max_num_seqs=1, aging_s=10.0)
    scheduler.add(prioritized("low", 10, 0.0, steps=2), ("a",))
    plan_of(scheduler)
    scheduler.note_progress({"low": (2, 2)})  # stepped its last; waits for company to decode
    scheduler.add(prioritized("urgent", 0, 1.0), ("a",))
    assert not scheduler.can_admit()
    plan_of(scheduler)
    assert scheduler.num_paused == 0
    scheduler.finish(["low"])
    assert joined(plan_of(scheduler)) == ["urgent"]


def test_a_requests_age_counts_from_its_arrival_running_and_paused_time_included() -> None:
    # Aging 1 s a level: a priority-10 request that arrived at 0 ranks as if it arrived at 10,
    # whether it waited, ran or was paused since. At 12 it is past its bound for a newcomer of
    # priority 0 arriving then (rank 12): not paused; one that arrived at 5 (rank 15) is.
    scheduler = StepScheduler(max_num_seqs=2, aging_s=1.0)
    scheduler.add(prioritized("old", 10, 0.0, steps=50), ("a",))
    scheduler.add(prioritized("young", 10, 5.0, steps=50), ("a",))
    for _ in range(3):
        plan_of(scheduler)
    scheduler.add(prioritized("urgent", 0, 12.0), ("a",))
    plan = plan_of(scheduler)
    assert joined(plan) == ["urgent"] and scheduler.is_paused("young") and not scheduler.is_paused("old")
    # Paused, "young" keeps its rank (15): a newcomer arriving at 16 does not pass it.
    scheduler.finish(["urgent"])
    scheduler.add(prioritized("later", 0, 16.0), ("a",))
    plan = plan_of(scheduler)
    assert plan.step == ("old", "young") and scheduler.num_waiting == 1


def test_a_better_request_of_another_size_pauses_by_the_padded_cost_of_a_mixed_group() -> None:
    """Over one step key for every size (a family that pads rows to one grid, issue 42):
    priorities preempt by what the group would cost padded. Beside 6x6 and 4x4 rows (2 x 36)
    an urgent 8x8 one makes 3 x 64 = 192 > 150, though their own tokens (116) would fit, so
    the worst running one pauses and the urgent one steps with the other (2 x 64 = 128)."""
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=150, aging_s=10.0)
    for name, priority, side in (("mid", 5, 6), ("low", 10, 4)):
        scheduler.add(prioritized(name, priority, 0.0), ("any size",), cost=side * side, grid=(side, side))
    assert plan_of(scheduler).step == ("mid", "low")
    scheduler.add(prioritized("urgent", 0, 1.0), ("any size",), cost=64, grid=(8, 8))
    plan = plan_of(scheduler)
    assert joined(plan) == ["urgent"] and plan.step == ("urgent", "mid")
    assert scheduler.is_paused("low") and scheduler.running_cost == 128
    scheduler.finish(["urgent"])
    plan = plan_of(scheduler)
    assert joined(plan) == [] and plan.step == ("mid", "low")  # resumed where it was
