"""Admission by deadline in step mode: when a newcomer would finish, with rows that step
together (`engine.sched.deadline_admission` has the refusal; this is the estimate it refuses by).

Request mode runs a batch to its end, so the work ahead of a newcomer is a queue of whole
batches and adding it up is right. In step mode the rows step together: a newcomer joins at
the next step boundary if a seat is free and steps beside the running rows, each step
taking the time of a *group* (`engine.sched.group_times`: a step of N rows costs far less than N
steps of one row). Adding every running request's steps one after another, as request mode
does, overshoots a tight deadline with a second request in flight (measured: a 2x-alone
deadline refused for most interactive requests, docs/benchmarks.md "Priorities and deadlines").

The estimate replays the scheduler's order on the rows that come before the newcomer (the
running ones in turn, then the paused and waiting ones it would serve first, then the
newcomer): rows take seats in that order while they fit (`engine.sched.step_fit`: images, step
budget); the first seated row's key steps, as a group of every seated row with that key, a
group step at a time, until its shortest row ends and frees its seat; and so on until the
newcomer's last step. Its own time alone (`own_s`) is its steps at its own cost; `ahead_s`
is the rest of its finish. Both are stretched by `HEADROOM`, as request mode's.

Where the scheduler does better than the replay, the estimate errs late: deadline-aware step
groups (`engine.sched.step_groups`) hold worse rows back from an urgent request's steps, and a
paused request the newcomer may pass (`engine.sched.passing`) is replayed ahead of it (whether it
may depends on the running work when it gets there, which the replay does not track). Under
step groups the engine leaves out of `ahead` the running rows the newcomer outranks, as
before: they step beside it only while it is on track, and preemption frees their seats
(with `--preemption off` they keep them, and the estimate can err early).

Pure: no clock (callers pass the time left), no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.request import BatchKey
from engine.sched.deadline_admission import HEADROOM, Estimate


@dataclass(frozen=True, slots=True)
class Row:
    """A request as the replay sees it: its step key, step cost, images and steps left."""

    key: BatchKey
    cost: int
    images: int
    steps: int


# The time of one step of a group of a key whose rows cost the given total; None: unknown.
StepTime = Callable[[BatchKey, int], float | None]


def step_estimate(
    ahead: Sequence[Row],
    own: Row,
    step_s: StepTime,
    max_num_seqs: int,
    max_step_cost: int | None = None,
) -> Estimate | None:
    """When a newcomer doing `own` is done, behind `ahead` (in the order the scheduler serves
    them); None when a step time it needs is unknown (nothing measured: admit)."""
    own_step = step_s(own.key, own.cost)
    if own_step is None:
        return None
    finish = _replay([*ahead, own], step_s, max_num_seqs, max_step_cost)
    if finish is None:
        return None
    own_s = own.steps * own_step
    return Estimate(HEADROOM * max(0.0, finish - own_s), HEADROOM * own_s)


def _replay(queue: list[Row], step_s: StepTime, max_num_seqs: int, max_step_cost: int | None) -> float | None:
    """Seconds until the last row of `queue` took its last step (see the module docstring)."""
    last = queue[-1]
    left = {id(row): row.steps for row in queue}
    waiting = deque(queue)  # every row ends once: O(rows x seats) in all
    seated: list[Row] = []
    now = 0.0
    while True:
        while waiting and _fits(waiting[0], seated, max_num_seqs, max_step_cost):
            seated.append(waiting.popleft())
        group = [row for row in seated if row.key == seated[0].key]
        step = step_s(group[0].key, sum(row.cost for row in group))
        if step is None:
            return None
        run = min(left[id(row)] for row in group)
        now += run * step
        for row in group:
            left[id(row)] -= run
        if left[id(last)] <= 0:
            return now
        seated = [row for row in seated if left[id(row)] > 0]


def _fits(row: Row, seated: list[Row], max_num_seqs: int, max_step_cost: int | None) -> bool:
    """Whether `row` takes a seat beside `seated` (alone, anything fits)."""
    if not seated:
        return True
    if sum(r.images for r in seated) + row.images > max_num_seqs:
        return False
    return max_step_cost is None or sum(r.cost for r in seated) + row.cost <= max_step_cost
