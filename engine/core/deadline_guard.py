"""`DeadlineGuard`: the engine's side of admission by deadline (`engine.sched.deadline_admission`):
the work it holds ahead of a new request, and the refusal of one that would finish late.
Mixed into `AsyncEngine`, which provides the attributes below."""

from __future__ import annotations

import logging
import time

from engine.core.config import EngineConfig
from engine.core.lanes import Lane
from engine.request import GenerationRequest, steps_to_run
from engine.sched.deadline_admission import Estimate, HeldWork, Work, estimate, refusal
from engine.sched.priority import by_priority
from engine.sched.scheduler import Scheduler
from engine.sched.step_admission import Row, step_estimate
from engine.sched.step_groups import outranks
from engine.sched.step_scheduler import StepScheduler
from engine.spec import PipelineSpec

logger = logging.getLogger("engine.core.engine")


class DeadlineGuard:
    # Set by AsyncEngine.
    config: EngineConfig
    batching: str
    _spec: PipelineSpec | None
    _held: dict[str, GenerationRequest]
    _lane_of: dict[str, Lane]
    _scheduler: Scheduler
    _work: HeldWork

    def _work_of(self, request: GenerationRequest) -> Work:
        """What an admitted request runs: its steps, each of its step cost, with the key it is
        batched by in this batching mode."""
        spec = self._spec
        assert spec is not None
        key = spec.step_key(request) if self.batching == "step" else spec.batch_key(request)
        return Work(key, spec.step_cost(request), steps_to_run(request.params))

    def _check_deadline(self, request: GenerationRequest, own: Work, lane: Lane | None, workers: int) -> None:
        """Refuse `request` (raise `DeadlineUnmeetableError`) if the work ahead of it, on
        `lane` (step mode) or spread over `workers` (request mode), would make it finish
        past its deadline."""
        if not self.config.deadline_admission or request.deadline is None:
            return
        if lane is not None and lane.steps is not None:
            found = self._step_estimate(request, own, lane.steps)
        else:
            found = estimate(self._work_ahead(request, own), own, self._work.rates, workers)
        error = refusal(found, request.deadline - time.monotonic())
        if error is not None:
            logger.info("request %s refused at admission: %s", request.request_id, error)
            raise error

    def _step_estimate(self, request: GenerationRequest, own: Work, steps: StepScheduler) -> Estimate | None:
        """Step mode: when `request` would finish on the lane `steps` schedules, its rows
        stepping in groups with those served before it (`engine.sched.step_admission`)."""
        aging_s = self.config.priority_aging_s
        running = by_priority(
            (r for r in self._held.values() if steps.is_running(r.request_id)), lambda r: r, aging_s
        )
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

    def _work_ahead(self, request: GenerationRequest, own: Work) -> list[Work]:
        """Request mode: what runs before `request`, every running request held and every
        waiting one its scheduler would serve first (by priority, deadline and fair share:
        the scheduler's own order), one batch after another."""
        running = [r for r in self._held.values() if self._scheduler.is_running(r.request_id)]
        first = self._scheduler.waiting_before(request, own.key)
        return [work for work in (self._work.left(r.request_id) for r in (*running, *first)) if work]
