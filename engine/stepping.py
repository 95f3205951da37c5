"""Running `StepPlan`s through a stepping pipeline, with per-request fate.

The hardware side of step-level batching, run wherever the pipeline lives (the executor
thread): `StepRunner` keeps each running request's denoising state between iterations,
prepares joiners, steps groups and finishes (decodes, together) those that took their
last step — on the stepping thread, or beside it on a decode thread (`engine.decoding`).
A stage that raises for a group is retried request by request, so only a request that
really fails gets the error; a failed request's state is freed at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from engine.decoding import DecodeOverlap, OverlapPolicy
from engine.forward import BatchOutput, DecodeRecord, ForwardRecord, adapter_of
from engine.request import GenerationRequest, InvalidRequestError, PartialImage, RequestOutput
from engine.step_scheduler import StepPlan

logger = logging.getLogger(__name__)


# Told each preview as soon as it is decoded (from the thread that steps).
PartialListener = Callable[[PartialImage], None]


class Flag(Protocol):
    """A flag the engine sets on the event loop and the pipeline's side reads while it runs:
    a `threading.Event` in-process, a multiprocessing event for a worker process."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class StepState(Protocol):
    request: GenerationRequest

    @property
    def steps_done(self) -> int: ...

    @property
    def total_steps(self) -> int: ...

    @property
    def is_done(self) -> bool: ...

    @property
    def num_images(self) -> int: ...

    # A clean-latent estimate waiting to be decoded as a preview, and how many were sent.
    preview: Any
    previews_sent: int


class StepPipeline(Protocol):
    def prepare(self, requests: list[GenerationRequest]) -> list[Any]: ...

    def step(self, states: list[Any]) -> None: ...

    def finish(self, states: list[Any]) -> list[RequestOutput]: ...

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]: ...


# A request that took its last step waits at most this many further steps of its group for
# others to finish, so their VAE decodes run together: decoding one image at a time costs
# about twice as much per image (`python -m bench.stage_times --model tiny-qwen-image`), and a
# decode stalls every other request's steps.
MAX_FINISH_WAIT_STEPS = 2


class StepRunner:
    """Runs `StepPlan`s where the pipeline lives, keeping each running request's state.

    `run` frees dropped states, prepares the joiners, then steps the group; while nothing
    changes it keeps stepping the same group here, because going back to the event loop
    after every step would leave the accelerator idle while the loop serves HTTP. It
    returns when requests are finished (decoded), one fails, previews are ready to send, or
    `attention` is set (a request arrived or was aborted), so the engine still acts at the
    next step boundary.

    Requests that took their last step are decoded together where that pays: on a model
    whose step costs less than decoding one image (`OverlapPolicy.worth_waiting`), they
    wait up to `MAX_FINISH_WAIT_STEPS` more steps for whoever finishes meanwhile — unless
    nothing else is still stepping, or they are at least as many as those still stepping
    and the rest will not all finish within the wait. Elsewhere (and until a step and a
    decode have been timed) they are decoded at once. With `decode_overlap` ("auto": when
    a decode is expected to take longer than a step) the decode runs on a thread of its
    own while the group goes on stepping;
    its outputs are returned by the first `run` after it is done (one waits for it when
    nothing else is left to step). The pipeline must then allow `finish` beside `step`,
    `prepare` and `preview` (`SteppedStages` serialises its VAE calls).
    """

    def __init__(
        self,
        pipeline: StepPipeline,
        on_partial: PartialListener | None = None,
        decode_overlap: DecodeOverlap = "off",
    ) -> None:
        self.pipeline = pipeline
        # Where previews go as soon as they are decoded; without one they ride in the result
        # and `run` returns early so that they are not held back.
        self.on_partial = on_partial
        self.states: dict[str, StepState] = {}
        # Done denoising, waiting to be decoded with others: steps waited so far.
        self.finishing: dict[str, int] = {}
        self.policy = OverlapPolicy(decode_overlap)
        self._decoder: ThreadPoolExecutor | None = None
        # Decodes running beside the steps; each ends as a BatchOutput of its own.
        self._decoding: set[Future[BatchOutput]] = set()
        self.decodes_beside = 0

    def run(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        result = BatchOutput()
        for request_id in plan.drop:
            self.states.pop(request_id, None)
            self.finishing.pop(request_id, None)
        if plan.join:
            _prepare(self.pipeline, self.states, list(plan.join), result)
        while True:
            stepping = self._stepping(plan)
            if stepping:
                self._step(stepping, result)
            done = [rid for rid in plan.step if rid in self.finishing and rid in self.states]
            still = self._stepping(plan)
            if done and self._decode_now(done, still):
                for request_id in done:
                    self.finishing.pop(request_id, None)
                if not self._decode_beside(done, result):
                    self._decode_here(done, result)
                    return result
            else:
                for request_id in done:
                    self.finishing[request_id] += 1
            if self._collect(result, block=not still):
                return result
            if not still or result.errors or result.partials or attention is None or attention.is_set():
                return result

    def _step(self, group: list[str], result: BatchOutput) -> None:
        _step(self.pipeline, self.states, group, result)
        if result.forwards[-1].ok:
            self.policy.observe_step(result.forwards[-1].seconds)
        self._send_previews(group, result)
        for request_id in group:
            state = self.states.get(request_id)
            if state is not None and state.is_done:
                self.finishing[request_id] = 0

    def close(self) -> None:
        """Wait for decodes running beside the steps (their outputs are dropped) and stop
        the decode thread."""
        if self._decoder is not None:
            self._decoder.shutdown(wait=True, cancel_futures=True)
            self._decoder = None

    def _decode_here(self, ids: list[str], result: BatchOutput) -> None:
        _decode(self.pipeline, self.states, ids, result, self.policy, beside=False)

    def _decode_beside(self, ids: list[str], result: BatchOutput) -> bool:
        """Start decoding `ids` on the decode thread if the policy says so; their states
        leave `states` (the decode thread owns them now) and `result.decoding` tells the
        engine, which gives their share of the steps to others."""
        images = sum(self.states[rid].num_images for rid in ids)
        if not self.policy.overlap(images):
            return False
        if self._decoder is None:
            logger.info("decoding finished requests beside the steps (decode_overlap %s)", self.policy.mode)
            self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffbatch-decode")
        self.decodes_beside += 1
        owned = {rid: self.states.pop(rid) for rid in ids}

        def decode() -> BatchOutput:
            output = BatchOutput()
            _decode(self.pipeline, owned, ids, output, self.policy, beside=True)
            return output

        self._decoding.add(self._decoder.submit(decode))
        result.decoding.extend(ids)
        return True

    def _collect(self, result: BatchOutput, *, block: bool) -> bool:
        """Move finished decodes' outputs into `result` (with `block`, wait for one first if
        any is running); True if there were any."""
        if not self._decoding:
            return False
        if block:
            wait(self._decoding, return_when=FIRST_COMPLETED)
        ready = [future for future in self._decoding if future.done()]
        for future in ready:
            self._decoding.discard(future)
            output = future.result()
            result.outputs.update(output.outputs)
            result.errors.update(output.errors)
            result.decodes.extend(output.decodes)
        return bool(ready)

    def _send_previews(self, group: list[str], result: BatchOutput) -> None:
        for partial in _preview(self.pipeline, self.states, group):
            if self.on_partial is not None:
                self.on_partial(partial)
            else:
                result.partials.append(partial)

    def _stepping(self, plan: StepPlan) -> list[str]:
        return [rid for rid in plan.step if rid in self.states and rid not in self.finishing]

    def _decode_now(self, done: list[str], still: list[str]) -> bool:
        waited = max(self.finishing[rid] for rid in done)
        if not still or waited >= MAX_FINISH_WAIT_STEPS:
            return True
        if not self.policy.worth_waiting(1):
            # A step costs more than decoding an image alone (tiny-sd: a step of 8 about 20
            # decodes of one): waiting for company would cost more latency than it saves.
            return True
        # The rest of the group finishes within the wait, cheaply: decode everyone then, so
        # no straggler is decoded alone (which would stall the next group's steps).
        left = max(self.states[rid].total_steps - self.states[rid].steps_done for rid in still)
        if waited + left <= MAX_FINISH_WAIT_STEPS and self.policy.worth_waiting(left):
            return False
        return len(done) >= len(still)


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
    adapter = adapter_of([states[rid].request for rid in group])
    try:
        pipeline.step([states[rid] for rid in group])
    except Exception as exc:  # noqa: BLE001 - it becomes the failing request's error
        seconds = time.perf_counter() - start
        result.forwards.append(ForwardRecord(len(group), images, seconds, ok=False, adapter=adapter))
        if len(group) == 1:
            _fail(result, group[0], "step", exc)
            states.pop(group[0], None)
            return
        # The forward runs before any state moves, so each request can retry this step.
        logger.warning("batched step of %d requests failed (%s); retrying one by one", len(group), exc)
        for request_id in group:
            _step(pipeline, states, [request_id], result)
        return
    seconds = time.perf_counter() - start
    result.forwards.append(ForwardRecord(len(group), images, seconds, ok=True, adapter=adapter))
    for request_id in group:
        state = states[request_id]
        result.progress[request_id] = (state.steps_done, state.total_steps)


def _preview(pipeline: StepPipeline, states: dict[str, StepState], group: list[str]) -> list[PartialImage]:
    """Decode the previews due after this step, together. A preview is a courtesy: if its
    decode fails the requests go on without it (and their final images are unaffected)."""
    ready = [rid for rid in group if rid in states and states[rid].preview is not None]
    if not ready:
        return []
    try:
        previews: list[tuple[Any, ...] | None] = list(pipeline.preview([states[rid] for rid in ready]))
    except Exception:
        logger.warning("preview decode failed for %s; they continue without it", ready, exc_info=True)
        previews = [None] * len(ready)
    partials = []
    for request_id, images in zip(ready, previews, strict=True):
        state = states[request_id]
        state.preview = None
        if images is None:
            continue
        partials.append(
            PartialImage(request_id, state.previews_sent, tuple(images), state.steps_done, state.total_steps)
        )
        state.previews_sent += 1
    return partials


def _decode(
    pipeline: StepPipeline,
    states: dict[str, StepState],
    ids: list[str],
    result: BatchOutput,
    policy: OverlapPolicy,
    *,
    beside: bool,
) -> None:
    """Finish `ids` together (every failure becomes an error entry), timed for the policy
    and recorded for the engine's metrics."""
    images = sum(states[rid].num_images for rid in ids)
    start = time.perf_counter()
    _finish(pipeline, states, ids, result)
    seconds = time.perf_counter() - start
    policy.observe_decode(images, seconds)
    ok = all(rid in result.outputs for rid in ids)
    result.decodes.append(DecodeRecord(len(ids), images, seconds, ok, beside))


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
