"""`DeadlineGuard`: the engine's side of admission by deadline (`engine.sched.deadline_admission`):
the work it holds ahead of a new request, and the refusal of one that would finish late.
The engine holds one; its admission queue asks it before holding a request."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from engine.request import GenerationRequest
from engine.sched.deadline_admission import Estimate, HeldWork, Work, estimate, refusal
from engine.sched.priority import by_priority
from engine.sched.scheduler import Scheduler
from engine.sched.step_admission import Row, step_estimate
from engine.sched.step_groups import outranks
from engine.sched.step_scheduler import StepScheduler

logger = logging.getLogger("engine.core.engine")


class DeadlineGuard:
    """Estimates from `work` (what each held request still has to run, and the step times
    learnt); refuses only when `enabled` (`--deadline-admission`)."""

    def __init__(self, work: HeldWork, *, enabled: bool, aging_s: float) -> None:
        self._work = work
        self._enabled = enabled
        self._aging_s = aging_s

    def check(
        self,
        request: GenerationRequest,
        own: Work,
        held: Iterable[GenerationRequest],
        where: Scheduler | StepScheduler,
        workers: int,
    ) -> None:
        """Refuse `request` (raise `DeadlineUnmeetableError`) if the work ahead of it would
        make it finish past its deadline: of the requests `held`, those `where` (a lane's
        step scheduler, step mode; the shared scheduler, request mode, spread over
        `workers`) serves before it."""
        if not self._enabled or request.deadline is None:
            return
        if isinstance(where, StepScheduler):
            found = self._step_estimate(request, own, held, where)
        else:
            found = estimate(self._work_ahead(request, own, held, where), own, self._work.rates, workers)
        error = refusal(found, request.deadline - time.monotonic())
        if error is not None:
            logger.info("request %s refused at admission: %s", request.request_id, error)
            raise error

    def _step_estimate(
        self, request: GenerationRequest, own: Work, held: Iterable[GenerationRequest], steps: StepScheduler
    ) -> Estimate | None:
        """Step mode: when `request` would finish on the lane `steps` schedules, its rows
        stepping in groups with those served before it (`engine.sched.step_admission`)."""
        aging_s = self._aging_s
        running = by_priority((r for r in held if steps.is_running(r.request_id)), lambda r: r, aging_s)
        if steps.pace is not None:
            # Deadline-aware step groups: rows it outranks step beside it only while it is on track.
            running = [r for r in running if not outranks(request, r, aging_s)]
        first = steps.waiting_before(request, own.key, own.cost)
        ahead = [
            row for row in (self._row(r) for r in (*running, *first)) if row is not None and row.steps > 0
        ]
        own_row = Row(own.key, own.cost, request.params.n, own.steps)
        return step_estimate(ahead, own_row, self._work.step_s, steps.max_num_seqs, steps.max_step_cost)

    def _row(self, request: GenerationRequest) -> Row | None:
        left = self._work.left(request.request_id)
        return None if left is None else Row(left.key, left.cost, request.params.n, left.steps)

    def _work_ahead(
        self, request: GenerationRequest, own: Work, held: Iterable[GenerationRequest], scheduler: Scheduler
    ) -> list[Work]:
        """Request mode: what runs before `request`, every running request held and every
        waiting one its scheduler would serve first (by priority, deadline and fair share:
        the scheduler's own order), one batch after another."""
        running = [r for r in held if scheduler.is_running(r.request_id)]
        first = scheduler.waiting_before(request, own.key)
        return [work for work in (self._work.left(r.request_id) for r in (*running, *first)) if work]
