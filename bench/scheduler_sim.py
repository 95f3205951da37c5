"""The step scheduler's policy measured alone: the real `StepScheduler` on a fake clock, no
server, no HTTP, no model, so a policy change shows without this machine's noise.

Each plan's step group takes `base + per_row x rows` time units (one step a tick with the
defaults of `tenants`; a CPU-like growth with rows for `slo`, where 8 rows step ~2.6x faster
per row than one, as tiny pipelines do on 2 cores, docs/FINDINGS). Arrivals are Poisson.

    python -m bench.scheduler_sim tenants   # heavy key at 10x a light key's rate, same priority
    python -m bench.scheduler_sim slo       # interactive (prio 0, 4-8 steps, deadline 2x alone)
                                            # + batch (prio 10, 32 steps), priority vs FIFO

`tenants` prints the light key's p99 latency over its alone time with preemption off, on
with the strict join order (a paused request blocks later ones, as before `engine.sched.passing`)
and on as the scheduler does now. `slo` prints interactive SLO attainment
(finished by the deadline; refused counts as missed) and batch throughput, priority vs FIFO
(every priority 0, deadlines kept: the bench's `fifo` arm), with deadline admission
(`engine.sched.step_admission`, fed the group step times the run measured) off and on.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import engine.sched.step_join as step_join_module
from engine.request import BatchKey, GenerationRequest, SamplingParams, steps_to_run
from engine.sched.deadline_admission import refusal
from engine.sched.group_times import GroupTimes
from engine.sched.priority import by_priority
from engine.sched.step_admission import Row, step_estimate
from engine.sched.step_groups import outranks
from engine.sched.step_scheduler import StepScheduler

KEY: BatchKey = ("sim",)
# Priority aging in time units: the engine's default 2 s at ~29 ms a step (tiny-sd, 32x32,
# on 2 CPU cores: 110 ms for 4 steps alone in docs/benchmarks.md "Priorities and deadlines", 117 ms
# in an earlier run).
AGING_UNITS = 70.0


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the trace: its class, sender, priority, steps and arrival."""

    name: str
    cls: str
    tenant: str
    priority: int
    steps: int
    arrival: float
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Device:
    """How long a step group takes: `base + per_row x rows` time units."""

    base: float
    per_row: float

    def step(self, rows: int) -> float:
        return self.base + self.per_row * rows


class _Pace:
    """`engine.sched.step_groups.Pace` on the fake clock, with the group step times the run measured."""

    def __init__(self, left: dict[str, int]) -> None:
        self.left, self.t = left, 0.0
        self.times = GroupTimes()

    def step_s(self, key: BatchKey, cost: int) -> float | None:
        return self.times.step_s(key, cost)

    def steps_left(self, request_id: str) -> int | None:
        return self.left.get(request_id)

    def now(self) -> float:
        return self.t


def request_of(spec: Spec, fifo: bool) -> GenerationRequest:
    params = SamplingParams(
        width=64, height=64, num_inference_steps=spec.steps, priority=0 if fifo else spec.priority
    )
    return replace(
        GenerationRequest(request_id=spec.name, prompt="", params=params, arrival_time=spec.arrival),
        tenant=spec.tenant,
        deadline=spec.deadline,
    )


def simulate(
    specs: list[Spec],
    device: Device,
    seats: int,
    *,
    fifo: bool = False,
    preemption: bool = True,
    groups: bool = True,
    admission: bool = False,
    aging: float = AGING_UNITS,
) -> dict[str, float | None]:
    """Each request's finish time (None: refused at admission), on the fake clock."""
    left: dict[str, int] = {}
    pace = _Pace(left)
    scheduler = StepScheduler(seats, aging_s=aging, preemption=preemption, pace=pace if groups else None)
    times = pace.times
    held: dict[str, GenerationRequest] = {}
    pending = sorted(specs, key=lambda s: s.arrival)
    finish: dict[str, float | None] = {}
    while pending or scheduler.has_work():
        while pending and pending[0].arrival <= pace.t:
            request = request_of(pending.pop(0), fifo)
            refused = admission and _refused(
                request, scheduler, held=held, left=left, times=times, groups=groups, now=pace.t
            )
            if refused:
                finish[request.request_id] = None
                continue
            held[request.request_id], left[request.request_id] = request, steps_to_run(request.params)
            scheduler.add(request, KEY, cost=1)
        plan = scheduler.schedule()
        if plan is None or not plan.step:
            pace.t = pending[0].arrival if pending else pace.t
            continue
        took = device.step(len(plan.step))
        pace.t += took
        times.learn(KEY, len(plan.step), took)
        ended = []
        for request_id in plan.step:
            left[request_id] -= 1
            if left[request_id] == 0:
                ended.append(request_id)
        for request_id in scheduler.finish(ended):
            finish[request_id] = pace.t
            del left[request_id], held[request_id]
    return finish


def _refused(
    request: GenerationRequest,
    scheduler: StepScheduler,
    *,
    held: dict[str, GenerationRequest],
    left: dict[str, int],
    times: GroupTimes,
    groups: bool,
    now: float,
) -> bool:
    """Admission by deadline as the engine does it in step mode (`engine.core.deadline_guard`)."""
    if request.deadline is None:
        return False
    aging = scheduler.aging_s
    running = by_priority(
        [r for r in held.values() if scheduler.is_running(r.request_id)], lambda r: r, aging
    )
    if groups:
        running = [r for r in running if not outranks(request, r, aging)]
    first = scheduler.waiting_before(request, KEY, 1)
    ahead = [Row(KEY, 1, 1, left[r.request_id]) for r in (*running, *first)]
    own = Row(KEY, 1, 1, steps_to_run(request.params))
    found = step_estimate(ahead, own, times.step_s, scheduler.max_num_seqs)
    # From when the engine sees it (a step may end after its arrival), as `deadline_guard`.
    return refusal(found, request.deadline - now) is not None


def poisson(rng: random.Random, rate: float, until: float) -> Iterator[float]:
    t = rng.expovariate(rate)
    while t < until:
        yield t
        t += rng.expovariate(rate)


@contextmanager
def strict_join_order() -> Iterator[None]:
    """A paused request blocks every later one (the order before `engine.sched.passing`)."""
    original = getattr(step_join_module, "may_pass")  # noqa: B009 (not exported)
    setattr(step_join_module, "may_pass", lambda *args: False)  # noqa: B010
    try:
        yield
    finally:
        setattr(step_join_module, "may_pass", original)  # noqa: B010


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latencies(specs: list[Spec], finish: dict[str, float | None], cls: str) -> list[float]:
    """The latencies of the requests of `cls` that ran."""
    return [end - s.arrival for s in specs if s.cls == cls and (end := finish[s.name]) is not None]


def tenants(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    device = Device(args.base, args.per_row)
    specs = [
        Spec(f"{cls[0]}{i}", cls, cls, 0, args.steps, t)
        for cls, rate in (("heavy", args.heavy), ("light", args.light))
        for i, t in enumerate(poisson(rng, rate, args.ticks))
    ]
    alone = args.steps * device.step(1)
    print(
        f"tenants: {args.seats} seats, {args.steps}-step requests, heavy {args.heavy}/unit, light "
        f"{args.light}/unit, {args.ticks:.0f} units, seed {args.seed}; alone {alone:.2f} units"
    )
    for name, preemption, strict in (
        ("preemption off", False, False),
        ("on, strict join order", True, True),
        ("on, paused may be passed", True, False),
    ):
        with strict_join_order() if strict else nullcontext():
            finish = simulate(
                specs, device, args.seats, preemption=preemption, groups=False, aging=args.aging
            )
        light, heavy = latencies(specs, finish, "light"), latencies(specs, finish, "heavy")
        print(
            f"  {name:26s} light p50 / p99 ÷ alone {pct(light, 0.5) / alone:.2f} / "
            f"{pct(light, 0.99) / alone:.2f} ({len(light)} light); "
            f"heavy p99 ÷ alone {pct(heavy, 0.99) / alone:.1f}"
        )


def slo(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    device = Device(args.base, args.per_row)
    mean_steps = 0.75 * 6 + 0.25 * 32
    capacity = args.seats / (mean_steps * device.step(args.seats))
    rate = args.load * capacity
    specs = []
    for i, t in enumerate(poisson(rng, rate, args.ticks)):
        if rng.random() < 0.75:
            steps = rng.choice((4, 6, 8))
            specs.append(Spec(f"i{i}", "interactive", "", 0, steps, t, t + 2 * steps * device.step(1)))
        else:
            specs.append(Spec(f"b{i}", "batch", "", 10, 32, t))
    print(
        f"slo: {args.seats} seats, step {args.base} + {args.per_row} x rows, capacity {capacity:.3f}/unit, "
        f"offered {rate:.3f}/unit ({args.load:.0%}), {args.ticks:.0f} units, seed {args.seed}"
    )
    interactive = [s for s in specs if s.cls == "interactive"]
    batch = [s for s in specs if s.cls == "batch"]
    for admission in (False, True):
        for arm in ("priority", "fifo"):
            finish = simulate(
                specs, device, args.seats, fifo=arm == "fifo", admission=admission, aging=args.aging
            )
            met = sum(
                1 for s in interactive if (end := finish[s.name]) is not None and end <= (s.deadline or 0)
            )
            refused = sum(1 for s in specs if finish[s.name] is None)
            span = max((end for s in batch if (end := finish[s.name]) is not None), default=1.0)
            done = len(latencies(specs, finish, "batch"))
            print(
                f"  admission {'on ' if admission else 'off'} {arm:8s} "
                f"interactive SLO {met / len(interactive):6.1%} "
                f"({met}/{len(interactive)}, {refused} refused)  batch {done / span:.4f}/unit "
                f"(p99 {pct(latencies(specs, finish, 'batch'), 0.99):.0f} units)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scenario", choices=("tenants", "slo"))
    parser.add_argument("--seats", type=int, default=None, help="max_num_seqs (tenants 4, slo 8)")
    parser.add_argument("--ticks", type=float, default=20_000.0, help="time units of arrivals")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--base", type=float, default=1.0, help="a step's time: base + per_row x rows")
    parser.add_argument("--per-row", type=float, default=None, help="(tenants 0, slo 0.4)")
    parser.add_argument("--steps", type=int, default=4, help="tenants: steps of every request")
    parser.add_argument("--heavy", type=float, default=1.0, help="tenants: heavy arrivals per unit")
    parser.add_argument("--light", type=float, default=0.1, help="tenants: light arrivals per unit")
    parser.add_argument("--aging", type=float, default=AGING_UNITS, help="time units per priority level")
    parser.add_argument("--load", type=float, default=0.8, help="slo: offered share of capacity")
    args = parser.parse_args()
    is_slo = args.scenario == "slo"
    args.seats = args.seats or (8 if is_slo else 4)
    args.per_row = args.per_row if args.per_row is not None else (0.4 if is_slo else 0.0)
    (slo if is_slo else tenants)(args)


if __name__ == "__main__":
    main()
