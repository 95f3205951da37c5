"""The step scheduler: which requests join, and which step together, at each step boundary.

Pure and synchronous, like `Scheduler`: no I/O, no event loop, no torch, no clock.

Step-level batching makes the unit of work one denoising step instead of a whole
request. Each iteration the engine asks for a `StepPlan`:

- **join**: waiting requests are admitted in turn (by priority, then age:
  `engine.sched.priority`; arrival order when all share one priority) while the running requests'
  images stay within `max_num_seqs` and their compute within `max_step_cost` (a request's
  `cost` is what it adds to a denoiser forward, rows x latent tokens, so 8 small images and
  one long video are not the same "batch of 8"); a request alone may exceed either.
  Strict order: the first that does not fit stops admission, so a large request is never
  passed over forever; only a paused one may be passed, by a request entitled to pause it
  (`engine.sched.passing`). They are prepared (prompt encoded, latents drawn) before this step.
  Among waiting requests of one priority, senders (API keys) take turns by fair share
  (`engine.sched.fair_share`): one sender's burst does not starve another's trickle.
- **step**: the first running request (by priority, then age; the oldest when all share
  one priority) chooses the step key (the latent shape and what
  else one forward must share); every running request with that key steps together,
  each at its own timestep, with its own step count, guidance and negative prompt. The
  first always goes, and aging bounds how long a worse priority is passed over, so nothing
  starves; requests with another key wait for their turn.
  With `pace` (deadline-aware step groups, `engine.sched.step_groups`), rows of worse priority
  step beside requests with a deadline only while the learnt step time keeps those on
  track; the others are held back, running, with their state, until they do.
  Admission keeps a group within the compute budget, except when the budget was just
  learnt lower (below): then the group is cut, in join order, to the budget, and the rest
  wait for the requests ahead of them to finish.
- **drop**: running (or paused) requests aborted since the last plan; their state is freed.

Who joins, with preemption and passing, is `StepJoins` (`engine.sched.step_join`).

The compute budget is `max_step_cost` until a step runs out of memory: the executor
reports what fitted (`BatchOutput.fits`) and `learn_memory` lowers the budget to it, then
raises it slowly while steps at it fit (`engine.sched.step_budget`).

A request leaves when the executor reports it finished (images) or failed. One whose
decode runs beside the steps (`engine.worker.decoding`) is `release`d first: it no longer counts
against `max_num_seqs` or the compute budget, so a newcomer can take its place at once,
but it is still owed its result.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.errors import DuplicateRequestError
from engine.outputs import StageFit
from engine.request import BatchKey, GenerationRequest, steps_to_run
from engine.sched.fair_share import FairShare
from engine.sched.priority import DEFAULT_AGING_S, check_aging_s, rank
from engine.sched.step_budget import StepBudget
from engine.sched.step_fit import group_cost
from engine.sched.step_groups import Pace, Row, deadline_group, group_step
from engine.sched.step_join import StepEntries, StepEntry, StepJoins
from engine.sched.step_plan import StepPlan


class StepScheduler:
    """One lane's step-level schedule. Who joins is the `StepJoins` it holds, over the
    entries both share."""

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
        # Deadline-aware step groups (`engine.sched.step_groups`); None: every candidate steps.
        self.pace = pace
        # Rows held back from a step for urgent ones, counted once per step they waited.
        self.held_back_row_steps = 0
        self._entries = StepEntries()
        self._joins = StepJoins(
            self._entries,
            self.budget,
            max_num_seqs=max_num_seqs,
            max_adapters=max_adapters,
            aging_s=aging_s,
            preemption=preemption,
        )
        # Denoised, being decoded beside the steps: owed a result, holding no step budget.
        self._decoding: set[str] = set()
        self._dropped: list[str] = []

    @property
    def fair_share(self) -> FairShare:
        """Each sender's share so far; moves as requests join the running ones."""
        return self._joins.fair_share

    def waiting_before(self, request: GenerationRequest, key: BatchKey, cost: int) -> list[GenerationRequest]:
        """The paused and waiting requests that would join before `request` were it added now
        (admission by deadline counts their steps)."""
        return self._joins.waiting_before(request, key, cost)

    def can_admit(self) -> bool:
        """Whether the next plan would admit (or resume) a request (`StepJoins.can_admit`):
        the engine interrupts running steps for an arrival only then."""
        return self._joins.can_admit()

    @property
    def max_step_cost(self) -> int | None:
        """The compute budget in force: as configured, or lower since memory ran out."""
        return self.budget.limit

    def learn_memory(self, fits: list[StageFit]) -> tuple[bool, str] | None:
        """Learn from the stages the executor ran (`StepBudget.learn`)."""
        return self.budget.learn(fits)

    @property
    def num_waiting(self) -> int:
        return len(self._entries.waiting)

    @property
    def num_running(self) -> int:
        return len(self._entries.running)

    @property
    def num_paused(self) -> int:
        return len(self._entries.paused)

    def is_paused(self, request_id: str) -> bool:
        return request_id in self._entries.paused

    @property
    def preemptions(self) -> int:
        """Requests paused so far (a request paused twice counts twice)."""
        return self._entries.paused.preemptions

    @property
    def running_images(self) -> int:
        return sum(entry.request.params.n for entry in self._entries.running.values())

    @property
    def running_cost(self) -> int:
        return _padded_cost(self._entries.running.values())

    @property
    def held_cost(self) -> int:
        """Step cost of every request waiting, running or paused here (routing between lanes,
        against the step budget: in its units, rows of mixed sizes padded)."""
        return _padded_cost(self._held_entries())

    @property
    def num_held(self) -> int:
        """Requests this scheduler holds in any state (waiting, running, paused, decoding)."""
        return (
            len(self._entries.waiting)
            + len(self._entries.running)
            + len(self._entries.paused)
            + len(self._decoding)
        )

    def held_keys(self) -> frozenset[BatchKey]:
        """The step keys of the requests waiting, running or paused here."""
        return frozenset(entry.key for entry in self._held_entries())

    def _held_entries(self) -> list[StepEntry]:
        return [
            *self._entries.waiting.values(),
            *self._entries.running.values(),
            *self._entries.paused.values(),
        ]

    @property
    def num_decoding(self) -> int:
        return len(self._decoding)

    def decoding_ids(self) -> list[str]:
        """The requests being decoded beside the steps (`release`d, still owed)."""
        return sorted(self._decoding)

    def has_request(self, request_id: str) -> bool:
        held = (self._entries.waiting, self._entries.running, self._entries.paused, self._decoding)
        return any(request_id in states for states in held)

    def is_running(self, request_id: str) -> bool:
        """Whether `request_id` runs now (admission by deadline counts its steps left)."""
        return request_id in self._entries.running

    def has_work(self) -> bool:
        return bool(
            self._entries.waiting
            or self._entries.running
            or self._entries.paused
            or self._dropped
            or self._decoding
        )

    def add(
        self,
        request: GenerationRequest,
        key: BatchKey,
        cost: int = 0,
        grid: tuple[int, ...] = (),
        packs: bool = False,
    ) -> None:
        """Hold a new request: its step key, step cost, and its rows' token grid where the key
        leaves the size out (`PipelineSpec.step_grid`: rows of mixed sizes are padded, unless
        all of a group pack: `packs`, `PipelineSpec.step_packs`)."""
        if self.has_request(request.request_id):
            raise DuplicateRequestError(request.request_id)
        self._entries.added += 1
        entry = StepEntry(request, key, cost, self._entries.added, grid=grid, packs=packs)
        self._entries.waiting[request.request_id] = entry

    def take_waiting(self) -> list[GenerationRequest]:
        """Hand over every waiting request, in arrival order (they hold nothing here yet)."""
        taken = [entry.request for entry in self._entries.waiting.values()]
        self._entries.waiting.clear()
        return taken

    def abort(self, request_id: str) -> bool:
        """Forget a request. True if it was waiting (so it never runs); a running or paused
        one leaves at the next step boundary and its state is freed by the next plan."""
        if self._entries.waiting.pop(request_id, None) is not None:
            return True
        if self._entries.running.pop(request_id, None) or self._entries.paused.pop(request_id):
            self._dropped.append(request_id)
        self._decoding.discard(request_id)  # its decode ends unheard
        return False

    def schedule(self) -> StepPlan | None:
        """The next iteration's plan, or None when there is nothing to do."""
        join = self._joins.admit()
        drop, self._dropped = tuple(self._dropped), []
        head = next(iter(self._joins.in_turn(self._entries.running)), None)
        if head is None:
            # Nothing steps; the executor still frees dropped states and hands over decodes.
            return StepPlan(join=(), step=(), drop=drop) if drop or self._decoding else None
        step = self._step_group(head.key)
        for request_id in step:
            self._entries.running[request_id].stepped = True
        paused = self._entries.paused.taken()
        return StepPlan(join=join, step=step, drop=drop, key=head.key, paused=paused)

    def _step_group(self, key: BatchKey) -> tuple[str, ...]:
        """The running requests with `key`, in turn, within the budget (the first always
        goes)."""
        group: list[StepEntry] = []
        limit = self.max_step_cost
        for entry in self._joins.in_turn(self._entries.running):
            if entry.key != key:
                continue
            # Mixed sizes: the padded cost of the group with it (`step_fit.group_cost`).
            if group and limit is not None and group_cost([*group, entry]) > limit:
                break
            group.append(entry)
        return self._deadline_group([entry.request.request_id for entry in group], key)

    def _deadline_group(self, group: list[str], key: BatchKey) -> tuple[str, ...]:
        """`group` less the rows held back for requests with a deadline (`step_groups`)."""
        if self.pace is None or len(group) < 2:
            return tuple(group)
        rows = [self._row(self._entries.running[request_id]) for request_id in group]
        kept = deadline_group(rows, group_step(self.pace, key), self.pace.now())
        self.held_back_row_steps += len(group) - len(kept)
        for request_id in set(group) - set(kept):
            # Held back, it is as good as paused (its state waits either way), so a better
            # newcomer may pause it for its slot: else rows held back since they joined,
            # never having stepped, would fill `max_num_seqs` and keep urgent work out.
            self._entries.running[request_id].stepped = True
        return tuple(kept)

    def _row(self, entry: StepEntry) -> Row:
        assert self.pace is not None
        request = entry.request
        left = self.pace.steps_left(request.request_id)
        steps = steps_to_run(request.params) if left is None else left
        priority, order = request.params.priority, rank(request, self.aging_s)
        return Row(request.request_id, priority, order, entry.cost, steps, request.deadline)

    def note_progress(self, progress: dict[str, tuple[int, int]]) -> None:
        """Steps done of total, as the executor reported them: a running request done
        denoising only waits for its decode (`engine.worker.stepping`), so it is not paused."""
        for request_id, (done, total) in progress.items():
            entry = self._entries.running.get(request_id)
            if entry is not None:
                entry.denoised = done >= total

    def release(self, request_ids: list[str]) -> None:
        """Requests done denoising whose decode runs beside the steps: their step budget is
        free from now on; they stay owed until `finish`."""
        for request_id in request_ids:
            if self._entries.running.pop(request_id, None) is not None:
                self._decoding.add(request_id)

    def finish(self, request_ids: list[str]) -> list[str]:
        """Requests the executor reported finished or failed; returns those still owed a
        result (not aborted meanwhile)."""
        owed = []
        for request_id in request_ids:
            # A paused one ends too when its worker dies (its state died with it).
            if self._entries.running.pop(request_id, None) or self._entries.paused.pop(request_id):
                owed.append(request_id)
            elif request_id in self._decoding:
                self._decoding.discard(request_id)
                owed.append(request_id)
        return owed


def _padded_cost(entries: Iterable[StepEntry]) -> int:
    """What `entries` cost in steps, as the budget counts them: the requests of one step key
    as one group (rows of mixed sizes padded to the grid holding them, `group_cost`)."""
    by_key: dict[BatchKey, list[StepEntry]] = {}
    for entry in entries:
        by_key.setdefault(entry.key, []).append(entry)
    return sum(group_cost(group) for group in by_key.values())
