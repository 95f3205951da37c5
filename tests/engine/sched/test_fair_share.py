"""Fair share between tenants in both schedulers, on a fake clock (arrival times built by
hand): no event loop, no torch."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.errors import InvalidRequestError
from engine.request import GenerationRequest
from engine.sched.fair_share import FairShare
from engine.sched.priority import by_priority
from engine.sched.scheduler import Scheduler
from engine.sched.step_scheduler import StepScheduler
from tests.engine.fakes import make_request


def sent(
    request_id: str,
    tenant: str,
    arrival: float = 0.0,
    *,
    weight: float = 1.0,
    priority: int = 0,
    steps: int = 4,
) -> GenerationRequest:
    request = make_request(request_id, arrival=arrival, steps=steps)
    params = replace(request.params, priority=priority)
    return replace(request, params=params, tenant=tenant, tenant_weight=weight)


def ids(requests: list[GenerationRequest]) -> list[str]:
    return [r.request_id for r in requests]


def serve(
    scheduler: Scheduler | StepScheduler, arrivals: list[GenerationRequest], ticks: int
) -> dict[str, float]:
    """Serve one request per second of a fake clock (max_num_seqs=1: a batch, or one
    request's only step); `arrivals` join the queue at their arrival times. Returns when
    each served request began."""
    pending = sorted(arrivals, key=lambda r: r.arrival_time)
    began: dict[str, float] = {}
    for tick in range(ticks):
        now = float(tick)
        while pending and pending[0].arrival_time <= now:
            scheduler.add(pending.pop(0), ("k",))
        if isinstance(scheduler, Scheduler):
            batch = scheduler.next_batch()
            served = batch.request_ids if batch is not None else []
            if batch is not None:
                scheduler.finish(batch)
        else:
            plan = scheduler.schedule()
            served = list(plan.step) if plan is not None else []
            scheduler.finish(served)
        for request_id in served:
            began[request_id] = now
    return began


def heavy_and_light(light_tenant: str) -> list[GenerationRequest]:
    """A heavy tenant sending 2 requests a second (twice what the server serves, so its
    queue grows) and a light one sending 1 every 5 s: 10x less."""
    heavy = [sent(f"h{i}", "heavy", i / 2) for i in range(120)]
    light = [sent(f"l{i}", light_tenant, 0.25 + 5 * i) for i in range(12)]
    return heavy + light


@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_light_tenants_trickle_is_not_queued_behind_a_heavy_tenants_burst(mode: str) -> None:
    def light_waits(light_tenant: str) -> list[float]:
        scheduler = Scheduler(max_num_seqs=1) if mode == "request" else StepScheduler(max_num_seqs=1)
        arrivals = heavy_and_light(light_tenant)
        began = serve(scheduler, arrivals, ticks=60)
        # A request not begun by the end has waited until then, at least.
        return [
            began.get(r.request_id, 60.0) - r.arrival_time for r in arrivals if r.request_id.startswith("l")
        ]

    fair = light_waits("light")
    # Each light request runs at the next turn after it arrives (one second of service).
    assert max(fair) <= 1.0, fair
    # The same arrivals from one tenant are served oldest-first: the light requests wait
    # behind the heavy backlog, longer and longer (what fair share removes).
    alone_in_line = light_waits("heavy")
    assert max(alone_in_line) > 20.0, alone_in_line


@pytest.mark.parametrize("mode", ["request", "step"])
def test_with_one_tenant_the_order_is_exactly_todays(mode: str) -> None:
    rng = random.Random(7)
    for tenant in ("", "key#1"):
        arrivals = sorted(rng.uniform(0, 10) for _ in range(40))
        requests = [
            sent(f"r{i}", tenant, arrival, priority=rng.choice([0, 0, 3, 10]), steps=rng.choice([4, 8]))
            for i, arrival in enumerate(arrivals)
        ]
        # Today's order: priority then age over the scheduler's own (arrival) order.
        expected = ids(by_priority(requests, lambda r: r, aging_s=2.0))
        scheduler = Scheduler(max_num_seqs=1) if mode == "request" else StepScheduler(max_num_seqs=1)
        for request in requests:
            scheduler.add(request, ("k",))
        order = []
        for _ in requests:
            if isinstance(scheduler, Scheduler):
                batch = scheduler.next_batch()
                assert batch is not None
                order += batch.request_ids
                scheduler.finish(batch)
            else:
                plan = scheduler.schedule()
                assert plan is not None
                order += list(plan.step)
                scheduler.finish(list(plan.step))
        assert order == expected


def test_backlogged_tenants_share_by_weight() -> None:
    share = FairShare()
    waiting = [sent(f"a{i}", "a", weight=2.0) for i in range(6)] + [sent(f"b{i}", "b") for i in range(6)]
    order = []
    for _ in range(9):
        head = share.order(waiting, lambda r: r)[0]
        share.admitted(head)
        waiting.remove(head)
        order.append(head.tenant)
    assert order.count("a") == 6 and order.count("b") == 3
    # Interleaved, not one tenant's run after another's.
    assert "".join(order) in {"abaabaaba", "aabaabaab", "baabaabaa"}, order


def test_work_is_images_times_steps() -> None:
    # The light tenant's one 32-step request costs as much as 8 of the heavy one's 4-step ones.
    share = FairShare()
    share.admitted(sent("long", "light", steps=32))
    waiting = [sent("light-next", "light", steps=4)] + [sent(f"h{i}", "heavy") for i in range(10)]
    order = ids(share.order(waiting, lambda r: r))
    assert order.index("light-next") == 8, order


def test_an_idle_tenant_banks_no_credit() -> None:
    share = FairShare()
    share.admitted(sent("a-old", "a"))
    for i in range(50):  # b alone for a long while
        share.admitted(sent(f"b{i}", "b"))
    waiting = [sent(f"a{i}", "a") for i in range(4)] + [sent(f"b-more{i}", "b") for i in range(4)]
    # a comes back at the virtual time of b's last request (which b has been charged for
    # already), so a goes twice, then the two take turns: no run of a's 49 "missed" turns.
    assert "".join(r.tenant for r in share.order(waiting, lambda r: r)) == "aabababb"


def test_fair_share_never_moves_a_request_across_priorities() -> None:
    share = FairShare()
    for i in range(5):
        share.admitted(sent(f"h{i}", "heavy"))
    waiting = [sent("h-urgent", "heavy", 1.0, priority=0), sent("l-batch", "light", 0.0, priority=10)]
    ranked = by_priority(waiting, lambda r: r, aging_s=2.0)
    assert ids(share.order(ranked, lambda r: r)) == ["h-urgent", "l-batch"]


def test_a_tenant_weight_must_be_positive_and_finite() -> None:
    for weight in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidRequestError) as caught:
            sent("x", "a", weight=weight)
        assert caught.value.param == "tenant_weight"


def test_the_tenant_is_not_in_the_sampling_parameters() -> None:
    # So it never changes an image or a batch key (adapters build keys from params).
    a, b = sent("x", "key#1"), sent("x", "key#2", weight=3.0)
    assert a.params == b.params


def test_a_kept_request_stays_in_its_place() -> None:
    # A paused request (preemption) was charged when it joined: it keeps its place.
    share = FairShare()
    for i in range(3):
        share.admitted(sent(f"h{i}", "heavy"))
    items = [sent("h-paused", "heavy"), sent("h-next", "heavy"), sent("l-next", "light")]
    order = share.order(items, lambda r: r, keep=lambda r: r.request_id == "h-paused")
    assert ids(order) == ["h-paused", "l-next", "h-next"]
