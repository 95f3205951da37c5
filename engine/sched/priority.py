"""Priority policy: the order in which the schedulers serve the requests they hold.

Pure: no clock, no I/O. A request has an integer `priority` (lower runs first, as vLLM's)
and an `arrival_time`. Time ages it: its effective priority improves by one level per
`aging_s` seconds since it arrived, so nobody starves. Every second counts the same, waiting,
running or paused: a request paused at a step boundary resumes with its age intact, and one
that has been in the engine past its bound is never paused again for newer work. Two
requests' effective priorities then compare the same at every instant, because both age
at the same rate: serving by effective priority, then age, is serving by

    rank = arrival_time + priority * aging_s

a request of priority p queues as if it had arrived p * aging_s seconds later. So a
request is passed over only by requests that arrive less than (its priority - theirs) *
aging_s seconds after it (the aging bound, which a test on a fake clock holds), and the
order needs no `now`, which keeps the schedulers clock-free.

When every request shares one priority the order is the schedulers' own (arrival order
at admission, join order once running), untouched.

Deadlines break ties among equals (earliest deadline first): the places in line that one
priority holds stay that priority's, but they go to its requests in deadline order, those
without a deadline after those with one (in their own order). So deadlines never move work
across priorities, and with one shared timeout (deadline = arrival + timeout) the order is
the same as without deadlines. Within its priority and its API key a request is passed
over only by requests due before it; across keys of one priority, fair share
(`engine.sched.fair_share`) decides whose turn it is, whatever their deadlines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from engine.request import GenerationRequest

# One level per 2 s waited: a priority-10 batch job outranks fresh priority-0 work
# after 20 s in the queue.
DEFAULT_AGING_S = 2.0

_T = TypeVar("_T")


def rank(request: GenerationRequest, aging_s: float) -> float:
    """Where `request` stands in line: its arrival, later by `aging_s` per priority level."""
    return request.arrival_time + request.params.priority * aging_s


def by_priority(
    items: Iterable[_T], request_of: Callable[[_T], GenerationRequest], aging_s: float
) -> list[_T]:
    """`items` (in the scheduler's own order) in the order they are served: by rank, ties in
    their given order, then each priority's places by deadline; unchanged when all share one
    priority and none has a deadline."""
    listed = list(items)
    if len({request_of(item).params.priority for item in listed}) > 1:
        listed.sort(key=lambda item: rank(request_of(item), aging_s))
    return earliest_deadline_first(listed, request_of)


def earliest_deadline_first(listed: list[_T], request_of: Callable[[_T], GenerationRequest]) -> list[_T]:
    """`listed` (in rank order) with the places each priority holds given to its requests by
    deadline, earliest first; no deadline after any deadline; ties keep their order."""
    if all(request_of(item).deadline is None for item in listed):
        return listed
    places: dict[int, list[int]] = {}
    for index, item in enumerate(listed):
        places.setdefault(request_of(item).params.priority, []).append(index)
    ordered = list(listed)
    for indices in places.values():
        members = sorted((listed[i] for i in indices), key=lambda item: _due(request_of(item)))
        for index, item in zip(indices, members, strict=True):
            ordered[index] = item
    return ordered


def _due(request: GenerationRequest) -> float:
    return float("inf") if request.deadline is None else request.deadline


def check_aging_s(aging_s: float) -> None:
    if isinstance(aging_s, bool) or not isinstance(aging_s, int | float) or not 0 < aging_s < float("inf"):
        raise ValueError(f"priority aging must be a finite number of seconds > 0, got {aging_s!r}")
