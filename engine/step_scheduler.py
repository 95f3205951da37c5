"""The step scheduler: which requests join, and which step together, at each step boundary.

Pure and synchronous, like `Scheduler`: no I/O, no event loop, no torch, no clock.

Step-level batching makes the unit of work one denoising step instead of a whole
request. Each iteration the engine asks for a `StepPlan`:

- **join**: waiting requests are admitted in turn (by priority, then age:
  `engine.priority`; arrival order when all share one priority) while the running requests'
  images stay within `max_num_seqs` and their compute within `max_step_cost` (a request's
  `cost` is what it adds to a denoiser forward, rows x latent tokens, so 8 small images and
  one long video are not the same "batch of 8"); a request alone may exceed either.
  Strict order: the first that does not fit stops admission, so a large request is never
  passed over forever; only a paused one may be passed, by a request entitled to pause it
  (`engine.passing`). They are prepared (prompt encoded, latents drawn) before this step.
  Among waiting requests of one priority, senders (API keys) take turns by fair share
  (`engine.fair_share`): one sender's burst does not starve another's trickle.
- **step**: the first running request (by priority, then age; the oldest when all share
  one priority) chooses the step key (the latent shape and what
  else one forward must share); every running request with that key steps together,
  each at its own timestep, with its own step count, guidance and negative prompt. The
  first always goes, and aging bounds how long a worse priority is passed over, so nothing
  starves; requests with another key wait for their turn.
  With `pace` (deadline-aware step groups, `engine.step_groups`), rows of worse priority
  step beside requests with a deadline only while the learnt step time keeps those on
  track; the others are held back, running, with their state, until they do.
  Admission keeps a group within the compute budget, except when the budget was just
  learnt lower (below): then the group is cut, in join order, to the budget, and the rest
  wait for the requests ahead of them to finish.
- **drop**: running (or paused) requests aborted since the last plan; their state is freed.

**Preemption** (`preemption`, on by default): when the first request in turn does not fit,
running requests it outranks (a strictly better priority, `engine.preemption`), or else
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

The compute budget is `max_step_cost` until a step runs out of memory: the executor
reports what fitted (`BatchOutput.fits`) and `learn_memory` lowers the budget to it, then
raises it slowly while steps at it fit (`engine.step_budget`).

A request leaves when the executor reports it finished (images) or failed. One whose
decode runs beside the steps (`engine.decoding`) is `release`d first: it no longer counts
against `max_num_seqs` or the compute budget, so a newcomer can take its place at once,
but it is still owed its result.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from engine.admission import steps_to_run
from engine.errors import DuplicateRequestError
from engine.fair_share import FairShare
from engine.passing import held_per_weight, joiners, may_pass
from engine.preemption import PausedRequests, fair_victims, resumed, victims
from engine.priority import DEFAULT_AGING_S, by_priority, check_aging_s, rank
from engine.request import BatchKey, GenerationRequest, RequestBatch
from engine.step_budget import StageFit, StepBudget
from engine.step_fit import fits
from engine.step_groups import Pace, Row, deadline_group, group_step


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One iteration of step-level batching, for the executor."""

    join: tuple[GenerationRequest, ...]
    step: tuple[str, ...]
    drop: tuple[str, ...] = ()
    key: BatchKey = ()


@dataclass(eq=False, slots=True)
class _Entry:
    request: GenerationRequest
    key: BatchKey
    cost: int
    seq: int = 0  # `engine.preemption.Held`
    stepped: bool = False
    denoised: bool = False


class StepScheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_step_cost: int | None = None,
        max_adapters: int | None = None,
        aging_s: float = DEFAULT_AGING_S,
        preemption: bool = True,
        *,
        pace: Pace | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_step_cost is not None and max_step_cost < 1:
            raise ValueError(f"max_step_cost must be >= 1, got {max_step_cost}")
        check_aging_s(aging_s)
        self.max_num_seqs = max_num_seqs
        self.aging_s = aging_s
        # A rise of a learnt budget adds one default request (the default budget's share).
        raise_by = max_step_cost // max_num_seqs if max_step_cost is not None else 1
        self.budget = StepBudget(max_step_cost, raise_by)
        self.max_adapters = max_adapters
        self.preemption = preemption
        # Deadline-aware step groups (`engine.step_groups`); None: every candidate steps.
        self.pace = pace
        # Rows held back from a step for urgent ones, counted once per step they waited.
        self.held_back_row_steps = 0
        # Dicts keep insertion order: arrival order for waiting, join order for running.
        self._waiting: dict[str, _Entry] = {}
        self._running: dict[str, _Entry] = {}
        # Preempted: state kept in the executor, out of the running set until they fit again.
        self._paused: PausedRequests[_Entry] = PausedRequests()
        self._added = 0
        # Denoised, being decoded beside the steps: owed a result, holding no step budget.
        self._decoding: set[str] = set()
        self._dropped: list[str] = []
        # Each sender's share so far; moves as requests join the running ones.
        self.fair_share = FairShare()

    @property
    def max_step_cost(self) -> int | None:
        """The compute budget in force: as configured, or lower since memory ran out."""
        return self.budget.limit

    def learn_memory(self, fits: list[StageFit]) -> tuple[bool, str] | None:
        """Learn from the stages the executor ran (`StepBudget.learn`)."""
        return self.budget.learn(fits)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    def is_paused(self, request_id: str) -> bool:
        return request_id in self._paused

    @property
    def preemptions(self) -> int:
        """Requests paused so far (a request paused twice counts twice)."""
        return self._paused.preemptions

    @property
    def running_images(self) -> int:
        return sum(entry.request.params.n for entry in self._running.values())

    @property
    def running_cost(self) -> int:
        return sum(entry.cost for entry in self._running.values())

    @property
    def held_cost(self) -> int:
        """Step cost of every request waiting, running or paused here (routing between lanes)."""
        return sum(entry.cost for entry in self._held_entries())

    @property
    def num_held(self) -> int:
        """Requests this scheduler holds in any state (waiting, running, paused, decoding)."""
        return len(self._waiting) + len(self._running) + len(self._paused) + len(self._decoding)

    def held_keys(self) -> frozenset[BatchKey]:
        """The step keys of the requests waiting, running or paused here."""
        return frozenset(entry.key for entry in self._held_entries())

    def _held_entries(self) -> list[_Entry]:
        return [*self._waiting.values(), *self._running.values(), *self._paused.values()]

    @property
    def num_decoding(self) -> int:
        return len(self._decoding)

    def decoding_ids(self) -> list[str]:
        """The requests being decoded beside the steps (`release`d, still owed)."""
        return sorted(self._decoding)

    def has_request(self, request_id: str) -> bool:
        held = (self._waiting, self._running, self._paused, self._decoding)
        return any(request_id in states for states in held)

    def is_running(self, request_id: str) -> bool:
        """Whether `request_id` runs now (admission by deadline counts its steps left)."""
        return request_id in self._running

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._paused or self._dropped or self._decoding)

    def add(self, request: GenerationRequest, key: BatchKey, cost: int = 0) -> None:
        if self.has_request(request.request_id):
            raise DuplicateRequestError(request.request_id)
        self._added += 1
        self._waiting[request.request_id] = _Entry(request, key, cost, self._added)

    def take_waiting(self) -> list[GenerationRequest]:
        """Hand over every waiting request, in arrival order (they hold nothing here yet)."""
        taken = [entry.request for entry in self._waiting.values()]
        self._waiting.clear()
        return taken

    def abort(self, request_id: str) -> bool:
        """Forget a request. True if it was waiting (so it never runs); a running or paused
        one leaves at the next step boundary and its state is freed by the next plan."""
        if self._waiting.pop(request_id, None) is not None:
            return True
        if self._running.pop(request_id, None) or self._paused.pop(request_id):
            self._dropped.append(request_id)
        self._decoding.discard(request_id)  # its decode ends unheard
        return False

    def schedule(self) -> StepPlan | None:
        """The next iteration's plan, or None when there is nothing to do."""
        join = self._admit()
        drop, self._dropped = tuple(self._dropped), []
        head = next(iter(self._in_turn(self._running)), None)
        if head is None:
            # Nothing steps; the executor still frees dropped states and hands over decodes.
            return StepPlan(join=(), step=(), drop=drop) if drop or self._decoding else None
        step = self._step_group(head.key)
        for request_id in step:
            self._running[request_id].stepped = True
        return StepPlan(join=join, step=step, drop=drop, key=head.key)

    def _step_group(self, key: BatchKey) -> tuple[str, ...]:
        """The running requests with `key`, in turn, within the budget (the first always
        goes)."""
        group: list[str] = []
        cost, limit = 0, self.max_step_cost
        for entry in self._in_turn(self._running):
            if entry.key != key:
                continue
            if group and limit is not None and cost + entry.cost > limit:
                break
            group.append(entry.request.request_id)
            cost += entry.cost
        if self.pace is None or len(group) < 2:
            return tuple(group)
        rows = [self._row(self._running[request_id]) for request_id in group]
        kept = deadline_group(rows, group_step(self.pace, key), self.pace.now())
        self.held_back_row_steps += len(group) - len(kept)
        for request_id in set(group) - set(kept):
            # Held back, it is as good as paused (its state waits either way), so a better
            # newcomer may pause it for its slot: else rows held back since they joined,
            # never having stepped, would fill `max_num_seqs` and keep urgent work out.
            self._running[request_id].stepped = True
        return tuple(kept)

    def _row(self, entry: _Entry) -> Row:
        assert self.pace is not None
        request = entry.request
        left = self.pace.steps_left(request.request_id)
        steps = steps_to_run(request.params) if left is None else left
        priority, order = request.params.priority, rank(request, self.aging_s)
        return Row(request.request_id, priority, order, entry.cost, steps, request.deadline)

    def _in_turn(self, entries: dict[str, _Entry]) -> list[_Entry]:
        """`entries` (waiting in arrival order, or running in join order) in the order they
        are served."""
        return by_priority(entries.values(), lambda entry: entry.request, self.aging_s)

    def waiting_before(self, request: GenerationRequest, key: BatchKey, cost: int) -> list[GenerationRequest]:
        """The paused and waiting requests that would join before `request` were it added now
        (admission by deadline counts their steps)."""
        probe = _Entry(request, key, cost, self._added + 1)
        ordered = self._join_order({**self._waiting, request.request_id: probe})
        return [entry.request for entry in ordered[: next(i for i, e in enumerate(ordered) if e is probe)]]

    def _join_order(self, waiting: dict[str, _Entry] | None = None) -> list[_Entry]:
        """Paused and waiting requests (`waiting`: those waiting now) in the order they join:
        in turn, waiting senders taking turns by fair share; a paused request keeps its place
        (it was charged on joining)."""
        ordered = self._in_turn(self._paused.ahead_of(self._waiting if waiting is None else waiting))
        return self.fair_share.order(
            ordered, lambda entry: entry.request, keep=lambda entry: entry.request.request_id in self._paused
        )

    def note_progress(self, progress: dict[str, tuple[int, int]]) -> None:
        """Steps done of total, as the executor reported them: a running request done
        denoising only waits for its decode (`engine.stepping`), so it is not paused."""
        for request_id, (done, total) in progress.items():
            entry = self._running.get(request_id)
            if entry is not None:
                entry.denoised = done >= total

    def release(self, request_ids: list[str]) -> None:
        """Requests done denoising whose decode runs beside the steps: their step budget is
        free from now on; they stay owed until `finish`."""
        for request_id in request_ids:
            if self._running.pop(request_id, None) is not None:
                self._decoding.add(request_id)

    def finish(self, request_ids: list[str]) -> list[str]:
        """Requests the executor reported finished or failed; returns those still owed a
        result (not aborted meanwhile)."""
        owed = []
        for request_id in request_ids:
            # A paused one ends too when its worker dies (its state died with it).
            if self._running.pop(request_id, None) or self._paused.pop(request_id):
                owed.append(request_id)
            elif request_id in self._decoding:
                self._decoding.discard(request_id)
                owed.append(request_id)
        return owed

    def can_admit(self) -> bool:
        """Whether the next plan would admit (or resume) a request: it fits beside those
        running, or pausing some makes it fit. The engine interrupts running steps for an
        arrival only then, since one that must wait anyway would only cost a trip to the
        event loop."""
        return next(self._joiners(), None) is not None

    def _admit(self) -> tuple[GenerationRequest, ...]:
        """Requests join in turn while they fit, a paused one resuming where it was (not in
        the plan's `join`: it is prepared); the first that does not fit may pause running
        requests it outranks (`engine.preemption`), else admission stops there, unless it is
        paused and those after it may pass it (`engine.passing`)."""
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

    def _joiners(self) -> Iterator[_Entry]:
        """Who joins next, in turn (`engine.passing.joiners`), asked lazily as they join."""
        return joiners(
            self._join_order(),
            lambda entry: self._room_for(entry) or bool(self._victims(entry)),
            lambda entry: entry.request.request_id in self._paused,
            lambda later, held: may_pass(later.request, held.request, self._held_per_weight, self.aging_s),
        )

    def _held_per_weight(self, request: GenerationRequest) -> float:
        return held_per_weight(request, ((e.request, self._footprint(e)) for e in self._running.values()))

    def _victims(self, entry: _Entry) -> list[_Entry]:
        if not self.preemption or not self._running:
            return []
        in_turn = self._in_turn(self._running)
        return victims(entry, in_turn, self._fits, self.aging_s) or fair_victims(
            entry, in_turn, self._fits, self._footprint
        )

    def _footprint(self, entry: _Entry) -> float:
        """What a running request holds (fair preemption): the larger of its share of the
        seats and of the step budget."""
        seats = entry.request.params.n / self.max_num_seqs
        limit = self.max_step_cost
        return seats if limit is None else max(seats, entry.cost / limit)

    def _room_for(self, entry: _Entry) -> bool:
        """Whether `entry` fits beside the running requests (alone, anything fits)."""
        return not self._running or self._fits(entry, self._running.values())

    def _fits(self, entry: _Entry, running: Iterable[_Entry]) -> bool:
        """Whether `entry` may run beside `running` (`engine.step_fit`)."""
        return fits(entry, running, self.max_num_seqs, self.max_step_cost, self.max_adapters)


def work_ids(work: RequestBatch | StepPlan) -> list[str]:
    """Every request a unit of work (a batch, or a step plan) touches."""
    if isinstance(work, RequestBatch):
        return work.request_ids
    return [*work.step, *(r.request_id for r in work.join if r.request_id not in work.step)]
