"""`StepPlan`: one iteration of step-level batching, what the step scheduler hands the
executor (as vLLM's scheduler hands out its `SchedulerOutput`), and `work_ids`: every
request a unit of work touches."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import BatchKey, GenerationRequest, RequestBatch


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One iteration of step-level batching, for the executor."""

    join: tuple[GenerationRequest, ...]
    step: tuple[str, ...]
    drop: tuple[str, ...] = ()
    key: BatchKey = ()
    # Running requests this plan paused for better ones (preempted; their state stays where
    # the executor holds it): the engine counts each request's pauses for its timeline.
    paused: tuple[str, ...] = ()


def work_ids(work: RequestBatch | StepPlan) -> list[str]:
    """Every request a unit of work (a batch, or a step plan) touches."""
    if isinstance(work, RequestBatch):
        return work.request_ids
    return [*work.step, *(r.request_id for r in work.join if r.request_id not in work.step)]
