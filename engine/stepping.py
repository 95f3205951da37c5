"""Running one `StepPlan` through a stepping pipeline, with per-request fate.

The hardware side of step-level batching, run wherever the pipeline lives (the executor
thread). It keeps each running request's denoising state between iterations, and each
iteration: frees dropped states, prepares the joiners, takes one batched step for the
step group, and finishes (decodes, together) those that took their last step. A stage
that raises for a group is retried request by request, so only a request that really
fails gets the error; a failed request's state is freed at once.
"""

from __future__ import annotations

import logging
import time
from threading import Event
from typing import Any, Protocol

from engine.forward import BatchOutput, ForwardRecord
from engine.request import GenerationRequest, InvalidRequestError, RequestOutput
from engine.step_scheduler import StepPlan

logger = logging.getLogger(__name__)


class StepState(Protocol):
    @property
    def steps_done(self) -> int: ...

    @property
    def total_steps(self) -> int: ...

    @property
    def is_done(self) -> bool: ...

    @property
    def num_images(self) -> int: ...


class StepPipeline(Protocol):
    def prepare(self, requests: list[GenerationRequest]) -> list[Any]: ...

    def step(self, states: list[Any]) -> None: ...

    def finish(self, states: list[Any]) -> list[RequestOutput]: ...


def run_step(
    pipeline: StepPipeline, states: dict[str, StepState], plan: StepPlan, attention: Event | None = None
) -> BatchOutput:
    """Run `plan`; then, while nothing changes, keep stepping the same group.

    Going back to the event loop after every step would leave the accelerator idle while
    the loop serves HTTP. So the group keeps stepping here until one of its requests
    finishes or fails, or `attention` is set (a request arrived or was aborted): the engine
    still acts at the very next step boundary.
    """
    result = BatchOutput()
    for request_id in plan.drop:
        states.pop(request_id, None)
    if plan.join:
        _prepare(pipeline, states, list(plan.join), result)
    group = [rid for rid in plan.step if rid in states]
    while group:
        _step(pipeline, states, group, result)
        finished = [rid for rid in group if rid in states and states[rid].is_done]
        if finished:
            _finish(pipeline, states, finished, result)
            break
        if result.errors or attention is None or attention.is_set():
            break
    return result


def _prepare(
    pipeline: StepPipeline,
    states: dict[str, StepState],
    requests: list[GenerationRequest],
    result: BatchOutput,
) -> None:
    try:
        prepared = pipeline.prepare(requests)
    except Exception as exc:  # noqa: BLE001 - it becomes the failing request's error
        if len(requests) == 1:
            _fail(result, requests[0].request_id, "prepare", exc)
            return
        for request in requests:
            _prepare(pipeline, states, [request], result)
        return
    states.update(zip((r.request_id for r in requests), prepared, strict=True))


def _step(
    pipeline: StepPipeline, states: dict[str, StepState], group: list[str], result: BatchOutput
) -> None:
    start = time.perf_counter()
    images = sum(states[rid].num_images for rid in group)
    try:
        pipeline.step([states[rid] for rid in group])
    except Exception as exc:  # noqa: BLE001 - it becomes the failing request's error
        result.forwards.append(ForwardRecord(len(group), images, time.perf_counter() - start, ok=False))
        if len(group) == 1:
            _fail(result, group[0], "step", exc)
            states.pop(group[0], None)
            return
        # The forward runs before any state moves, so each request can retry this step.
        logger.warning("batched step of %d requests failed (%s); retrying one by one", len(group), exc)
        for request_id in group:
            _step(pipeline, states, [request_id], result)
        return
    result.forwards.append(ForwardRecord(len(group), images, time.perf_counter() - start, ok=True))
    for request_id in group:
        state = states[request_id]
        result.progress[request_id] = (state.steps_done, state.total_steps)


def _finish(
    pipeline: StepPipeline, states: dict[str, StepState], ids: list[str], result: BatchOutput
) -> None:
    try:
        outputs = pipeline.finish([states[rid] for rid in ids])
        if [o.request_id for o in outputs] != ids:
            raise RuntimeError("finish() must return one RequestOutput per state, in order")
    except Exception as exc:  # noqa: BLE001 - it becomes the failing request's error
        if len(ids) == 1:
            _fail(result, ids[0], "finish", exc)
            states.pop(ids[0], None)
            return
        for request_id in ids:
            _finish(pipeline, states, [request_id], result)
        return
    for request_id, output in zip(ids, outputs, strict=True):
        states.pop(request_id, None)
        result.outputs[request_id] = output


def _fail(result: BatchOutput, request_id: str, stage: str, exc: Exception) -> None:
    if isinstance(exc, InvalidRequestError):  # the caller's input, said in the response
        logger.info("%s refused request %s: %s", stage, request_id, exc)
    else:
        logger.exception("%s failed for request %s", stage, request_id, exc_info=exc)
    result.errors[request_id] = exc
