"""`DeadlineGuard`: the engine's side of admission by deadline (`engine.deadline_admission`):
the work it holds ahead of a new request, and the refusal of one that would finish late.
Mixed into `AsyncEngine`, which provides the attributes below."""

from __future__ import annotations

import logging
import time

from engine.admission import steps_to_run
from engine.config import EngineConfig
from engine.deadline_admission import HeldWork, Work, estimate, refusal
from engine.executor import PipelineSpec
from engine.lanes import Lane
from engine.request import GenerationRequest
from engine.scheduler import Scheduler
from engine.step_groups import outranks
from engine.step_scheduler import StepScheduler

logger = logging.getLogger("engine.engine")


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
        found = estimate(self._work_ahead(request, own, lane), own, self._work.rates, workers)
        error = refusal(found, request.deadline - time.monotonic())
        if error is not None:
            logger.info("request %s refused at admission: %s", request.request_id, error)
            raise error

    def _work_ahead(self, request: GenerationRequest, own: Work, lane: Lane | None) -> list[Work]:
        """What runs before `request`: every running request held (on `lane` in step mode; with
        deadline-aware step groups, those it outranks only step beside it: `engine.step_groups`), and
        every paused or waiting one its scheduler would serve first (by priority, deadline and
        fair share: the scheduler's own order)."""
        holder = lane.steps if lane is not None and lane.steps is not None else self._scheduler
        running = [r for r in self._held.values() if holder.is_running(r.request_id)]
        if isinstance(holder, StepScheduler) and holder.pace is not None:
            # Deadline-aware step groups: rows it outranks step beside it only while it is on track.
            running = [r for r in running if not outranks(request, r, self.config.priority_aging_s)]
        if isinstance(holder, Scheduler):
            first = holder.waiting_before(request, own.key)
        else:
            first = holder.waiting_before(request, own.key, own.cost)
        return [work for work in (self._work.left(r.request_id) for r in (*running, *first)) if work]
