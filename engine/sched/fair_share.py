"""Fair share between tenants (API keys): which sender's request goes next among requests of
one priority, so one tenant's burst does not starve another's trickle.

Start-time fair queuing (weighted fair queuing that needs no clock): each tenant has a
virtual finish time, the work it has been given divided by its weight. Admitting a
request of tenant t starts it at `max(finish[t], now)` and moves `finish[t]` on by the
request's work (images x denoising steps) over t's weight; `now`, the virtual time, is
the start of the request admitted last. Among the requests waiting, each tenant's first
one would start at `max(finish[t], now)`, and the earliest start goes first. A tenant
that was idle comes back at `now`: it gets its turn at once but banks no credit for the
time it sent nothing, so it cannot burst ahead of everyone later.

The state (`FairShare`) lives in a scheduler and moves only when it admits a request
(`admitted`); `order` is a pure function of it and the waiting requests, with no clock.
It composes with the priority order (`engine.sched.priority.by_priority`): the places that
order gives to requests of one priority are refilled with those requests in fair order,
each tenant's own requests keeping their given order. So fair share never moves a
request across priorities, and with one tenant (or no keys: every tenant is "") the
order is the given one, untouched.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.request import GenerationRequest, steps_to_run

_T = TypeVar("_T")


def work(request: GenerationRequest) -> int:
    """What one request costs its tenant: its images times its denoising steps."""
    return request.params.n * steps_to_run(request.params)


@dataclass(slots=True)
class FairShare:
    """Each tenant's virtual finish time, and the virtual time now."""

    _finish: dict[str, float] = field(default_factory=dict)
    _now: float = 0.0

    def start(self, tenant: str) -> float:
        """Where `tenant`'s next request would start in virtual time."""
        return max(self._finish.get(tenant, 0.0), self._now)

    def admitted(self, request: GenerationRequest) -> None:
        """`request` was admitted (joined a batch, or the running requests): charge its tenant."""
        start = self.start(request.tenant)
        self._now = start
        self._finish[request.tenant] = start + work(request) / request.tenant_weight
        # A tenant at or behind `now` starts at `now` anyway: forget it (bounded state).
        self._finish = {tenant: finish for tenant, finish in self._finish.items() if finish > start}

    def order(
        self,
        items: Iterable[_T],
        request_of: Callable[[_T], GenerationRequest],
        keep: Callable[[_T], bool] | None = None,
    ) -> list[_T]:
        """`items` (in priority order) with each priority's places taken in fair order; those
        `keep` marks (paused requests, charged already) stay where they are."""
        listed = list(items)
        if len({request_of(item).tenant for item in listed}) <= 1:
            return listed
        places: dict[int, list[int]] = {}
        for index, item in enumerate(listed):
            if keep is None or not keep(item):
                places.setdefault(request_of(item).params.priority, []).append(index)
        ordered = list(listed)
        for indexes in places.values():
            fair = self._interleave([listed[i] for i in indexes], request_of)
            for index, item in zip(indexes, fair, strict=True):
                ordered[index] = item
        return ordered

    def _interleave(self, items: list[_T], request_of: Callable[[_T], GenerationRequest]) -> list[_T]:
        """`items` with the tenant whose next request starts earliest (in virtual time) first,
        as if each were admitted in turn; ties go to the request given first."""
        queues: dict[str, deque[tuple[int, _T]]] = {}
        for position, item in enumerate(items):
            queues.setdefault(request_of(item).tenant, deque()).append((position, item))
        # (virtual start, position of the tenant's next request, tenant)
        heap = [(self.start(tenant), queue[0][0], tenant) for tenant, queue in queues.items()]
        heapq.heapify(heap)
        ordered: list[_T] = []
        while heap:
            start, _, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            _, item = queue.popleft()
            ordered.append(item)
            if queue:
                request = request_of(item)
                heapq.heappush(heap, (start + work(request) / request.tenant_weight, queue[0][0], tenant))
        return ordered
