"""Preemption at step boundaries: which running requests pause so that a better one can join.

Pure: no clock, no I/O, no torch. `StepScheduler` asks at each plan, for the first request in
turn (waiting, or paused) that does not fit beside those running (`max_num_seqs`, the step
budget, the adapters the model holds).

The rule, and why it cannot thrash:

- A running request may be paused for `head` only if `head` **outranks** it: a strictly
  better (lower) priority *and* a better rank (`engine.sched.priority.rank`, so aging counts: a
  batch job that has waited long enough is not paused for fresh interactive work). Equal
  priorities never preempt one another by this rule (between tenants, see below).
- Victims go worst first, in the reverse of the order the scheduler serves in, until `head`
  fits; if pausing every eligible one still leaves no room, none pauses.
- A request pauses only after it has **stepped since it joined or resumed** (it was in a
  plan's step group): every resume buys at least one step, so a request is never resumed
  and paused again without moving, whatever arrives. One that took its last step is not
  paused: it only waits, a few steps at most, to be decoded with others (`engine.worker.stepping`).
- Ranks never change, so a request is paused again only for a newcomer that outranks it
  (or, below, for a tenant that holds less), never by the scheduler going back and forth
  between the same requests.

**Between tenants** (senders, `engine.sched.fair_share`), when the priority rule finds nothing: a
request of tenant T that does not fit may pause running requests *of its own priority* of
another tenant A (`fair_victims`), only while

- A holds more than its weighted share of the running work of that priority and T less
  (a request's work is its footprint: the larger of its share of the seats and of the step
  budget; a share is a tenant's weight over the weights of the tenants running there plus T),
- and, after the pause and the join, A still holds at least as much per weight as T: no
  overshoot, so A's paused request cannot take its place back from T next (it would then
  hold more per weight than T, which it never may), and tenants cannot pass a request back
  and forth.

The most over-served tenant gives first (per weight), its latest request first, until T's
request fits; none if that cannot make room. The same rule as above holds (a request pauses
only after it stepped), and it never crosses priorities: a worse-priority request never
pauses a better one this way. With one tenant (or no keys) there is no other tenant to take
from: nothing changes.

A paused request keeps its denoising state where the executor holds it (on the device, in
the worker), and resumes from the same step when it fits again, ahead of newcomers of its
own rank. Its state (latents, prompt embeddings, a scheduler copy) is not moved to host
memory when device memory runs short: it is small beside the activations of a step, which
the step budget (`engine.sched.step_budget`) bounds for the running requests; the paused ones'
states are not bounded by it, and many of them add up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from engine.request import GenerationRequest
from engine.sched.priority import rank


class Held(Protocol):
    """A request as the step scheduler holds it."""

    request: GenerationRequest
    # Order of arrival at the scheduler: where a resumed request goes back in line.
    seq: int
    # In a plan's step group since it joined or resumed: only then may it pause.
    stepped: bool
    # Took its last step, waits to be decoded (a few steps at most): it is not paused.
    denoised: bool


_H = TypeVar("_H", bound=Held)


def outranks(better: GenerationRequest, worse: GenerationRequest, aging_s: float) -> bool:
    """Whether `better` may pause `worse`: a strictly lower priority and an earlier rank."""
    return better.params.priority < worse.params.priority and rank(better, aging_s) < rank(worse, aging_s)


def victims(
    head: _H, running: Sequence[_H], fits: Callable[[_H, list[_H]], bool], aging_s: float
) -> list[_H]:
    """The running requests to pause so that `head` fits: worst first, until it does, of
    those `head` outranks that stepped since they joined or resumed and have steps left. `running` is in the
    order the scheduler serves it (best first); `fits(head, others)` says whether `head` may
    run beside `others`. Empty when pausing cannot make room."""
    chosen: set[int] = set()
    for held in reversed(running):
        if not held.stepped or held.denoised or not outranks(head.request, held.request, aging_s):
            continue
        chosen.add(id(held))
        left = [other for other in running if id(other) not in chosen]
        if not left or fits(head, left):
            return [other for other in reversed(running) if id(other) in chosen]
    return []


class PausedRequests(Generic[_H]):
    """The requests paused on one worker, by id (their state is kept by its executor), and
    how many pauses there have been."""

    def __init__(self) -> None:
        self._held: dict[str, _H] = {}
        self.preemptions = 0
        # Paused since the scheduler last took them (`taken`), for its next plan.
        self._news: list[str] = []

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def values(self) -> list[_H]:
        return list(self._held.values())

    def pop(self, request_id: str) -> _H | None:
        return self._held.pop(request_id, None)

    def pause(self, running: dict[str, _H], chosen: list[_H]) -> None:
        """Move `chosen` out of `running` (which keeps the rest in their order)."""
        for held in chosen:
            request_id = held.request.request_id
            del running[request_id]
            self._held[request_id] = held
            self._news.append(request_id)
        self.preemptions += len(chosen)

    def taken(self) -> tuple[str, ...]:
        """The requests paused since the last call, in order (each once per pause)."""
        news, self._news = tuple(self._news), []
        return news

    def ahead_of(self, waiting: dict[str, _H]) -> dict[str, _H]:
        """Who may join, before the scheduler's ordering: paused requests in arrival order,
        then `waiting`, so that in turn a paused request goes ahead of waiting ones of its
        rank."""
        ordered = sorted(self._held.values(), key=lambda held: held.seq)
        return {**{held.request.request_id: held for held in ordered}, **waiting}


def resumed(running: dict[str, _H], held: _H) -> dict[str, _H]:
    """`running` with `held` back in its place among them (by arrival: join order serves
    ties)."""
    ordered = sorted([*running.values(), held], key=lambda entry: entry.seq)
    return {entry.request.request_id: entry for entry in ordered}


def fair_victims(
    head: _H, running: Sequence[_H], fits: Callable[[_H, list[_H]], bool], footprint: Callable[[_H], float]
) -> list[_H]:
    """The running requests of `head`'s priority to pause so that `head` fits, taken from
    tenants over their weighted share of that priority's running work while `head`'s tenant
    is under its own (see the module docstring); `running` is in the order the scheduler
    serves it, `footprint` what one request holds. Empty when that cannot make room."""
    priority, tenant = head.request.params.priority, head.request.tenant
    peers = [held for held in running if held.request.params.priority == priority]
    holds = _holdings(peers, footprint)
    weights = {held.request.tenant: held.request.tenant_weight for held in peers}
    weights[tenant] = head.request.tenant_weight
    share = sum(holds.values()) / sum(weights.values())  # fair work per unit of weight
    if holds.get(tenant, 0.0) / weights[tenant] >= share:
        return []
    # T's work per weight once `head` joins: a tenant that gives keeps at least that (less a
    # rounding error: footprints are fractions such as 1/3, and a tie must count as kept).
    floor = (holds.get(tenant, 0.0) + footprint(head)) / weights[tenant] - 1e-9
    candidates = {
        name: [h for h in reversed(peers) if h.request.tenant == name and h.stepped and not h.denoised]
        for name in holds
        if name != tenant and holds[name] / weights[name] > share
    }
    chosen: list[_H] = []
    while True:
        giving = [name for name, queue in candidates.items() if queue]
        if not giving:
            return []
        name = max(giving, key=lambda n: holds[n] / weights[n])
        held = candidates[name].pop(0)
        if (holds[name] - footprint(held)) / weights[name] < floor:
            continue  # pausing this one would overshoot; a smaller one of A's may not
        holds[name] -= footprint(held)
        chosen.append(held)
        left = [other for other in running if all(other is not c for c in chosen)]
        if not left or fits(head, left):
            return chosen


def _holdings(running: Sequence[_H], footprint: Callable[[_H], float]) -> dict[str, float]:
    """Each tenant's running work."""
    holds: dict[str, float] = {}
    for held in running:
        holds[held.request.tenant] = holds.get(held.request.tenant, 0.0) + footprint(held)
    return holds
