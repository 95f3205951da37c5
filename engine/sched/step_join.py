"""`StepJoins`: who joins the running requests at a step boundary (`StepScheduler`'s join),
in turn, while they fit; who is paused to make room; who may pass a paused request. The step
scheduler holds one, over the entries both share (`StepEntries`).

**Preemption** (`preemption`, on by default): when the first request in turn does not fit,
running requests it outranks (a strictly better priority, `engine.sched.preemption`), or else
running requests of its priority from a tenant over its fair share while its own tenant is
under its share, **pause**:
they leave the running set, so they neither step nor count against the bounds above, but
keep their state in the executor, and they resume from the same step, ahead of waiting
requests of their own rank, once they fit again. A resumed request is not in `join` (it is
prepared already). A paused request is still held: an abort drops its state.

With `max_adapters` (the pipeline's `max_loras`), admission also stops, in the same strict
order, at a request whose LoRA adapter would make more distinct adapters run at once than
the model holds: otherwise preparing it would unload an adapter a running group needs, to
be loaded again at that group's next step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine.request import BatchKey, GenerationRequest
from engine.sched.fair_share import FairShare
from engine.sched.passing import held_per_weight, joiners, may_pass
from engine.sched.preemption import PausedRequests, fair_victims, resumed, victims
from engine.sched.priority import by_priority
from engine.sched.step_budget import StepBudget
from engine.sched.step_fit import fits


@dataclass(eq=False, slots=True)
class StepEntry:
    """A request the step scheduler holds (waiting, running or paused)."""

    request: GenerationRequest
    key: BatchKey
    cost: int
    seq: int = 0  # `engine.sched.preemption.Held`
    # Its rows' token grid where the step key leaves the size out (`step_fit.group_cost`).
    grid: tuple[int, ...] = ()
    packs: bool = False  # its rows packed beside other sizes (`step_fit.group_cost`)
    stepped: bool = False
    denoised: bool = False


@dataclass(slots=True)
class StepEntries:
    """The requests a step scheduler holds, by state. Dicts keep insertion order: arrival
    order for waiting, join order for running."""

    waiting: dict[str, StepEntry] = field(default_factory=dict)
    running: dict[str, StepEntry] = field(default_factory=dict)
    # Preempted: state kept in the executor, out of the running set until they fit again.
    paused: PausedRequests[StepEntry] = field(default_factory=PausedRequests)
    # Requests added so far (each entry's `seq`).
    added: int = 0


class StepJoins:
    """Admits from `entries` within `max_num_seqs`, the budget's step cost and
    `max_adapters`; `fair_share` is each sender's share so far, moved as requests join."""

    def __init__(
        self,
        entries: StepEntries,
        budget: StepBudget,
        *,
        max_num_seqs: int,
        max_adapters: int | None,
        aging_s: float,
        preemption: bool,
    ) -> None:
        self._entries = entries
        self._budget = budget
        self.max_num_seqs = max_num_seqs
        self.max_adapters = max_adapters
        self.aging_s = aging_s
        self.preemption = preemption
        self.fair_share = FairShare()

    def in_turn(self, entries: dict[str, StepEntry]) -> list[StepEntry]:
        """`entries` (waiting in arrival order, or running in join order) in the order they
        are served."""
        return by_priority(entries.values(), lambda entry: entry.request, self.aging_s)

    def waiting_before(self, request: GenerationRequest, key: BatchKey, cost: int) -> list[GenerationRequest]:
        """The paused and waiting requests that would join before `request` were it added now
        (admission by deadline counts their steps)."""
        probe = StepEntry(request, key, cost, self._entries.added + 1)
        ordered = self._join_order({**self._entries.waiting, request.request_id: probe})
        return [entry.request for entry in ordered[: next(i for i, e in enumerate(ordered) if e is probe)]]

    def _join_order(self, waiting: dict[str, StepEntry] | None = None) -> list[StepEntry]:
        """Paused and waiting requests (`waiting`: those waiting now) in the order they join:
        in turn, waiting senders taking turns by fair share; a paused request keeps its place
        (it was charged on joining)."""
        ordered = self.in_turn(
            self._entries.paused.ahead_of(self._entries.waiting if waiting is None else waiting)
        )
        return self.fair_share.order(
            ordered,
            lambda entry: entry.request,
            keep=lambda entry: entry.request.request_id in self._entries.paused,
        )

    def can_admit(self) -> bool:
        """Whether the next plan would admit (or resume) a request: it fits beside those
        running, or pausing some makes it fit. The engine interrupts running steps for an
        arrival only then, since one that must wait anyway would only cost a trip to the
        event loop."""
        return next(self._joiners(), None) is not None

    def admit(self) -> tuple[GenerationRequest, ...]:
        """Requests join in turn while they fit, a paused one resuming where it was (not in
        the plan's `join`: it is prepared); the first that does not fit may pause running
        requests it outranks (`engine.sched.preemption`), else admission stops there, unless it is
        paused and those after it may pass it (`engine.sched.passing`)."""
        joined: list[GenerationRequest] = []
        for entry in self._joiners():
            if not self._room_for(entry):
                self._entries.paused.pause(self._entries.running, self._victims(entry))
            request_id = entry.request.request_id
            entry.stepped = False
            if self._entries.paused.pop(request_id) is not None:
                self._entries.running = resumed(self._entries.running, entry)
            else:
                del self._entries.waiting[request_id]
                self._entries.running[request_id] = entry
                self.fair_share.admitted(entry.request)
                joined.append(entry.request)
        return tuple(joined)

    def _joiners(self) -> Iterator[StepEntry]:
        """Who joins next, in turn (`engine.sched.passing.joiners`), asked lazily as they join."""
        return joiners(
            self._join_order(),
            lambda entry: self._room_for(entry) or bool(self._victims(entry)),
            lambda entry: entry.request.request_id in self._entries.paused,
            lambda later, held: may_pass(
                later.request,
                held.request,
                self._held_per_weight,
                self.aging_s,
                self._footprint(later) / later.request.tenant_weight,
            ),
        )

    def _held_per_weight(self, request: GenerationRequest) -> float:
        return held_per_weight(
            request, ((e.request, self._footprint(e)) for e in self._entries.running.values())
        )

    def _victims(self, entry: StepEntry) -> list[StepEntry]:
        if not self.preemption or not self._entries.running:
            return []
        in_turn = self.in_turn(self._entries.running)
        return victims(entry, in_turn, self._fits, self.aging_s) or fair_victims(
            entry, in_turn, self._fits, self._footprint
        )

    def _footprint(self, entry: StepEntry) -> float:
        """What a running request holds (fair preemption): the larger of its share of the
        seats and of the step budget."""
        seats = entry.request.params.n / self.max_num_seqs
        limit = self._budget.limit
        return seats if limit is None else max(seats, entry.cost / limit)

    def _room_for(self, entry: StepEntry) -> bool:
        """Whether `entry` fits beside the running requests (alone, anything fits)."""
        return not self._entries.running or self._fits(entry, self._entries.running.values())

    def _fits(self, entry: StepEntry, running: Iterable[StepEntry]) -> bool:
        """Whether `entry` may run beside `running` (`engine.sched.step_fit`)."""
        return fits(entry, running, self.max_num_seqs, self._budget.limit, self.max_adapters)
