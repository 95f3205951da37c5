"""`StepJoins`: who joins the running requests at a step boundary (`StepScheduler`'s join),
in turn, while they fit; who is paused to make room; who may pass a paused request.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.request import BatchKey, GenerationRequest
from engine.sched.fair_share import FairShare
from engine.sched.passing import held_per_weight, joiners, may_pass
from engine.sched.preemption import PausedRequests, fair_victims, resumed, victims
from engine.sched.priority import by_priority
from engine.sched.step_fit import fits


@dataclass(eq=False, slots=True)
class StepEntry:
    """A request the step scheduler holds (waiting, running or paused)."""

    request: GenerationRequest
    key: BatchKey
    cost: int
    seq: int = 0  # `engine.sched.preemption.Held`
    stepped: bool = False
    denoised: bool = False


class StepJoins:
    # Set by StepScheduler.
    max_num_seqs: int
    aging_s: float
    max_adapters: int | None
    preemption: bool
    fair_share: FairShare
    _waiting: dict[str, StepEntry]
    _running: dict[str, StepEntry]
    _paused: PausedRequests[StepEntry]
    _added: int

    if TYPE_CHECKING:  # provided by StepScheduler

        @property
        def max_step_cost(self) -> int | None: ...

    def _in_turn(self, entries: dict[str, StepEntry]) -> list[StepEntry]:
        """`entries` (waiting in arrival order, or running in join order) in the order they
        are served."""
        return by_priority(entries.values(), lambda entry: entry.request, self.aging_s)

    def waiting_before(self, request: GenerationRequest, key: BatchKey, cost: int) -> list[GenerationRequest]:
        """The paused and waiting requests that would join before `request` were it added now
        (admission by deadline counts their steps)."""
        probe = StepEntry(request, key, cost, self._added + 1)
        ordered = self._join_order({**self._waiting, request.request_id: probe})
        return [entry.request for entry in ordered[: next(i for i, e in enumerate(ordered) if e is probe)]]

    def _join_order(self, waiting: dict[str, StepEntry] | None = None) -> list[StepEntry]:
        """Paused and waiting requests (`waiting`: those waiting now) in the order they join:
        in turn, waiting senders taking turns by fair share; a paused request keeps its place
        (it was charged on joining)."""
        ordered = self._in_turn(self._paused.ahead_of(self._waiting if waiting is None else waiting))
        return self.fair_share.order(
            ordered, lambda entry: entry.request, keep=lambda entry: entry.request.request_id in self._paused
        )

    def can_admit(self) -> bool:
        """Whether the next plan would admit (or resume) a request: it fits beside those
        running, or pausing some makes it fit. The engine interrupts running steps for an
        arrival only then, since one that must wait anyway would only cost a trip to the
        event loop."""
        return next(self._joiners(), None) is not None

    def _admit(self) -> tuple[GenerationRequest, ...]:
        """Requests join in turn while they fit, a paused one resuming where it was (not in
        the plan's `join`: it is prepared); the first that does not fit may pause running
        requests it outranks (`engine.sched.preemption`), else admission stops there, unless it is
        paused and those after it may pass it (`engine.sched.passing`)."""
        joined: list[GenerationRequest] = []
        for entry in self._joiners():
            if not self._room_for(entry):
                self._paused.pause(self._running, self._victims(entry))
            request_id = entry.request.request_id
            entry.stepped = False
            if self._paused.pop(request_id) is not None:
                self._running = resumed(self._running, entry)
            else:
                del self._waiting[request_id]
                self._running[request_id] = entry
                self.fair_share.admitted(entry.request)
                joined.append(entry.request)
        return tuple(joined)

    def _joiners(self) -> Iterator[StepEntry]:
        """Who joins next, in turn (`engine.sched.passing.joiners`), asked lazily as they join."""
        return joiners(
            self._join_order(),
            lambda entry: self._room_for(entry) or bool(self._victims(entry)),
            lambda entry: entry.request.request_id in self._paused,
            lambda later, held: may_pass(
                later.request,
                held.request,
                self._held_per_weight,
                self.aging_s,
                self._footprint(later) / later.request.tenant_weight,
            ),
        )

    def _held_per_weight(self, request: GenerationRequest) -> float:
        return held_per_weight(request, ((e.request, self._footprint(e)) for e in self._running.values()))

    def _victims(self, entry: StepEntry) -> list[StepEntry]:
        if not self.preemption or not self._running:
            return []
        in_turn = self._in_turn(self._running)
        return victims(entry, in_turn, self._fits, self.aging_s) or fair_victims(
            entry, in_turn, self._fits, self._footprint
        )

    def _footprint(self, entry: StepEntry) -> float:
        """What a running request holds (fair preemption): the larger of its share of the
        seats and of the step budget."""
        seats = entry.request.params.n / self.max_num_seqs
        limit = self.max_step_cost
        return seats if limit is None else max(seats, entry.cost / limit)

    def _room_for(self, entry: StepEntry) -> bool:
        """Whether `entry` fits beside the running requests (alone, anything fits)."""
        return not self._running or self._fits(entry, self._running.values())

    def _fits(self, entry: StepEntry, running: Iterable[StepEntry]) -> bool:
        """Whether `entry` may run beside `running` (`engine.sched.step_fit`)."""
        return fits(entry, running, self.max_num_seqs, self.max_step_cost, self.max_adapters)
