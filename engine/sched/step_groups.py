"""Deadline-aware step groups: which worse-priority rows may step beside urgent ones.

In step mode every running request with the step key steps together. On a device where a
step's time grows with its rows (a CPU: about linearly), an interactive request of 4-8
steps stepping with seven 32-step batch rows runs ~8x slower than alone and misses a
deadline of twice its alone time, although the group fits the step budget (so preemption,
`engine.sched.preemption`, never triggers). Here rows of worse priority join a step only while
the estimated step time with them keeps every better-priority request with a deadline on
track: its steps left x the group's step time, stretched by `HEADROOM`, fits its time left.

The step time is the learnt time of a step of a group of that total step cost
(`engine.sched.group_times`, the model admission by deadline plans with in step mode: a step of N
rows costs far less than N steps of one; before any group of the key was measured, the cost
x the learnt seconds per cost-step); with nothing learnt yet, nobody is held back. The rule:

- Rows are considered in the order the scheduler serves them (best first). A row is held
  back only for a guarded request (one with a deadline among the candidates) that outranks
  it: a strictly better priority *and* an earlier rank (`engine.sched.priority.rank`: aging
  counts, so a batch row that has waited long enough is never held back, and nothing
  starves).
- A guarded request is protected only while it is on track with the rows that must go (a
  request already past saving would hold batch rows back for nothing).
- Rows of the same or better priority than every guarded request always go: with no
  deadlines, or one priority, the group is exactly the scheduler's.

Held-back rows stay running: they wait at the step boundary with their state in the
executor, as rows of another step key do, and step again once the urgent requests finish
or have slack. So admission by deadline (`engine.core.deadline_guard`) does not count running
requests a newcomer outranks as work ahead of it: they step beside it only while it stays on
track, which its own estimate (with the same headroom) already asks.

Pure: no clock (callers pass `now`), no I/O, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.request import BatchKey, GenerationRequest
from engine.sched.deadline_admission import HEADROOM, HeldWork
from engine.sched.priority import rank

# The time of one step of a group whose rows cost the given total.
GroupStep = Callable[[int], float]


@dataclass(frozen=True, slots=True)
class Row:
    """A running request that could step now: what the rule needs of it."""

    request_id: str
    priority: int
    rank: float  # `engine.sched.priority.rank`: lower is served first
    cost: int  # its step cost (rows x latent tokens)
    steps_left: int
    deadline: float | None  # `time.monotonic()` reading, like `GenerationRequest.deadline`


def deadline_group(
    rows: Sequence[Row], step_time: GroupStep | float | None, now: float, headroom: float = HEADROOM
) -> list[str]:
    """The ids of `rows` (in the scheduler's order, best first, the candidates of one step)
    that step now; the others are held back. `step_time`: a group's step time by its cost,
    or seconds per cost-step (a step takes that times the cost). All of them when nothing is
    learnt (None) or no row has a deadline."""
    if step_time is None or not any(row.deadline is not None for row in rows):
        return [row.request_id for row in rows]
    if isinstance(step_time, float | int):
        seconds_per_cost = float(step_time)
        step_time = lambda cost: seconds_per_cost * cost  # noqa: E731
    guarded = [row for row in rows if row.deadline is not None]
    # Rows that go whatever happens: nobody with a deadline outranks them.
    must = [row for row in rows if not any(_outranks(g, row) for g in guarded)]
    cost = sum(row.cost for row in must)
    # Protected: those on track with the rows that must go.
    protected = [g for g in guarded if _on_track(g, cost, step_time, now, headroom)]
    kept = {row.request_id for row in must}
    for row in rows:
        if row.request_id in kept:
            continue
        blockers = [g for g in protected if _outranks(g, row)]
        if all(_on_track(g, cost + row.cost, step_time, now, headroom) for g in blockers):
            kept.add(row.request_id)
            cost += row.cost
    return [row.request_id for row in rows if row.request_id in kept]


def _outranks(better: Row, worse: Row) -> bool:
    """As `engine.sched.preemption.outranks`: a strictly better priority and an earlier rank."""
    return better.priority < worse.priority and better.rank < worse.rank


def outranks(better: GenerationRequest, worse: GenerationRequest, aging_s: float) -> bool:
    """Whether `worse`, running, is held back rather than ahead when `better` has a deadline:
    admission by deadline does not count its steps as work ahead of `better`."""
    return better.params.priority < worse.params.priority and rank(better, aging_s) < rank(worse, aging_s)


def _on_track(row: Row, group_cost: int, step_time: GroupStep, now: float, headroom: float) -> bool:
    assert row.deadline is not None
    return headroom * row.steps_left * step_time(group_cost) <= row.deadline - now


class Pace(Protocol):
    """What the step scheduler asks of the engine to shape a group: the learnt time of a step
    of a group of a key costing `cost` (None: nothing learnt), a running request's steps
    left, and the time."""

    def step_s(self, key: BatchKey, cost: int) -> float | None: ...

    def steps_left(self, request_id: str) -> int | None: ...

    def now(self) -> float: ...


def group_step(pace: Pace, key: BatchKey) -> GroupStep | None:
    """`pace`'s step time of groups of `key` by their cost; None before any was learnt."""
    if pace.step_s(key, 1) is None:
        return None
    return lambda cost: pace.step_s(key, cost) or 0.0


class WorkPace:
    """`Pace` from the engine's `HeldWork` (the same learnt rates admission by deadline uses)."""

    def __init__(self, work: HeldWork, clock: Callable[[], float] = time.monotonic) -> None:
        self._work = work
        self._clock = clock

    def step_s(self, key: BatchKey, cost: int) -> float | None:
        return self._work.step_s(key, cost)

    def steps_left(self, request_id: str) -> int | None:
        left = self._work.left(request_id)
        return None if left is None else left.steps

    def now(self) -> float:
        return self._clock()
