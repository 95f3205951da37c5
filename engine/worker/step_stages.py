"""The stages of step-level batching run over a group of requests, with per-request fate.

`StageRunner` calls a stepping pipeline's prepare, step, preview and finish for a group and
records what happened: a group whose stage raises is retried in halves (as `run_batch`
does), so only a request that really fails gets the error. Each stage reports what fitted
or ran out (`StageFit`), in step cost; only steps' reports move the step budget
(`engine.sched.step_budget`: a prepare's or finish's group is not the running set it bounds). A failed
step moves no request (`Pipeline.step`'s promise), so each retry steps it once.

Steps are timed with the pipeline's `StageTimer` (`engine.worker.timing`) and their records wait
in `unread` until the device has got past them; `read_times` files them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine.outputs import BatchOutput, DecodeRecord, ForwardRecord, PrepareRecord, Stage, StageFit
from engine.request import GenerationRequest, InvalidRequestError, PartialImage, RequestOutput
from engine.sched.step_fit import group_cost
from engine.worker.forward import PipelineCounters, adapter_of, is_out_of_memory
from engine.worker.moderation import ModeratedPipeline, moderate_outputs, moderate_previews
from engine.worker.timing import HostClock, Span, StageTimer

logger = logging.getLogger("engine.worker.stepping")


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


class StepPipeline(PipelineCounters, ModeratedPipeline, Protocol):
    def step_cost(self, request: GenerationRequest) -> int: ...

    def step_grid(self, request: GenerationRequest) -> tuple[int, ...]: ...

    def step_packs(self, request: GenerationRequest) -> bool: ...

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]: ...

    def step(self, states: list[Any]) -> None: ...

    def finish(self, states: list[Any]) -> list[RequestOutput]: ...

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]: ...

    def stage_timer(self) -> StageTimer | None:
        """What times the stages on the pipeline's device, or None where the host's clock
        is right (`engine.worker.timing`)."""
        ...


class StageRunner:
    """The stages of one pipeline, over the running requests' `states` (which it frees when
    a request fails or is finished)."""

    def __init__(self, pipeline: StepPipeline) -> None:
        self.pipeline = pipeline
        offered = pipeline.stage_timer()
        self.timer: StageTimer = offered if offered is not None else HostClock()
        # Steps whose span the device may not have got past yet, oldest first, each with
        # its record (seconds filled in when read) and the requests it stepped.
        self.unread: deque[tuple[Span, ForwardRecord, list[str]]] = deque()

    def read_times(
        self, states: dict[str, Any], result: BatchOutput, *, wait: bool, observe: Callable[[float], None]
    ) -> None:
        """File the steps' records the device has got past (with `wait`, all of them: it
        waits for the device), oldest first; `observe` hears the seconds of each step that
        fitted and had the device to itself (not `shared` with a decode). Reading a span is
        where a device's asynchronous error surfaces: the requests of that step fail
        (`_span_failed`)."""
        while self.unread:
            span, record, group = self.unread[0]
            try:
                if not wait and not span.ready():
                    return  # a device runs its queue in order: the later ones are not done either
                record = replace(record, seconds=span.seconds())
            except Exception as exc:  # noqa: BLE001 - it becomes the step's requests' error
                self._span_failed(states, result, "step", group, exc)
                record = replace(record, ok=False)
            self.unread.popleft()
            result.forwards.append(record)
            if record.ok and not record.shared:
                observe(record.seconds)

    def prepare(self, states: dict[str, Any], requests: list[GenerationRequest], result: BatchOutput) -> None:
        started = time.monotonic()
        try:
            prepared = self.pipeline.prepare(requests)
        except Exception as exc:  # noqa: BLE001 - it becomes the failing request's error
            if self._failed(result, "prepare", [r.request_id for r in requests], exc, self._cost(requests)):
                middle = len(requests) // 2
                for part in (requests[:middle], requests[middle:]):
                    self.prepare(states, part, result)
            return
        self._fitted(result, "prepare", self._cost(requests))
        ids = tuple(r.request_id for r in requests)
        result.prepares.append(PrepareRecord(ids, started, time.monotonic() - started))
        states.update(zip(ids, prepared, strict=True))

    def step(
        self, states: dict[str, Any], group: list[str], result: BatchOutput, *, shared: bool = False
    ) -> None:
        requests = [states[rid].request for rid in group]
        images = sum(states[rid].num_images for rid in group)
        record = ForwardRecord(
            len(group),
            images,
            0.0,
            ok=True,
            adapter=adapter_of(requests),
            shared=shared,
            request_ids=tuple(group),
            started=time.monotonic(),
            sizes=len({(r.params.width, r.params.height, r.params.num_frames) for r in requests}),
        )
        skipped = self.pipeline.cache_blocks_skipped()
        span, compiled = self.timer.start(), self.pipeline.compiled_graphs()
        try:
            self.pipeline.step([states[rid] for rid in group])
        except Exception as exc:  # noqa: BLE001 - it becomes the failing request's error
            span.stop()
            failed = replace(record, ok=False, out_of_memory=is_out_of_memory(exc))
            self.unread.append((span, failed, []))  # its requests have their error already
            if self._failed(result, "step", group, exc, self._cost(requests)):
                middle = len(group) // 2
                for part in (group[:middle], group[middle:]):
                    self.step(states, part, result, shared=shared)
            else:
                states.pop(group[0], None)
            return
        span.stop()
        record = replace(
            record,
            cache_blocks_skipped=self.pipeline.cache_blocks_skipped() - skipped,
            compiles=self.pipeline.compiled_graphs() - compiled,
        )
        self.unread.append((span, record, group))
        self._fitted(result, "step", self._cost(requests))
        for request_id in group:
            state = states[request_id]
            result.progress[request_id] = (state.steps_done, state.total_steps)

    def preview(self, states: dict[str, Any], group: list[str], result: BatchOutput) -> list[PartialImage]:
        """Decode the previews due after this step, together, and check them (a flagged one
        is withheld: `engine.worker.moderation`). A preview is a courtesy: if its decode
        fails the requests go on without it (and their final images are unaffected)."""
        ready = [rid for rid in group if rid in states and states[rid].preview is not None]
        if not ready:
            return []
        try:
            decoded = self.pipeline.preview([states[rid] for rid in ready])
            previews: list[tuple[Any, ...] | None] = list(decoded)
        except Exception:
            logger.warning("preview decode failed for %s; they continue without it", ready, exc_info=True)
            previews = [None] * len(ready)
        previews = moderate_previews(self.pipeline, [states[rid].request for rid in ready], previews, result)
        partials = []
        for request_id, images in zip(ready, previews, strict=True):
            state = states[request_id]
            state.preview = None
            if images is None:
                continue
            at = (state.steps_done, state.total_steps)
            partials.append(PartialImage(request_id, state.previews_sent, tuple(images), *at))
            state.previews_sent += 1
        return partials

    def decode(self, states: dict[str, Any], ids: list[str], result: BatchOutput, *, beside: bool) -> float:
        """Finish `ids` together (every failure becomes an error entry), recorded for the
        engine's metrics; returns the decode's seconds. Its images reach the host before
        `finish` returns, so the device is past the decode's end and reading it waits for
        nothing; the steps queued before it are not in its time (its span starts after
        them on the device)."""
        images = sum(states[rid].num_images for rid in ids)
        requests = {rid: states[rid].request for rid in ids}
        started, span = time.monotonic(), self.timer.start()
        self.finish(states, ids, result)
        span.stop()
        try:
            seconds = span.seconds()
        except Exception as exc:  # noqa: BLE001 - it becomes the decode's requests' error
            self._span_failed(states, result, "finish", ids, exc)
            seconds = 0.0
        ok = all(rid in result.outputs for rid in ids)
        result.decodes.append(DecodeRecord(len(ids), images, seconds, ok, beside, tuple(ids), started))
        # After the decode's time: the checker's is its own, not the VAE's.
        moderate_outputs(self.pipeline, requests, result)
        return seconds

    def finish(self, states: dict[str, Any], ids: list[str], result: BatchOutput) -> None:
        requests = [states[rid].request for rid in ids]
        try:
            outputs = self.pipeline.finish([states[rid] for rid in ids])
            if [o.request_id for o in outputs] != ids:
                raise RuntimeError("finish() must return one RequestOutput per state, in order")
        except Exception as exc:  # noqa: BLE001 - it becomes the failing request's error
            if self._failed(result, "finish", ids, exc, self._cost(requests)):
                middle = len(ids) // 2
                for part in (ids[:middle], ids[middle:]):
                    self.finish(states, part, result)
            else:
                states.pop(ids[0], None)
            return
        self._fitted(result, "finish", self._cost(requests))
        for request_id, output in zip(ids, outputs, strict=True):
            states.pop(request_id, None)
            result.outputs[request_id] = output

    def _span_failed(
        self, states: dict[str, Any], result: BatchOutput, stage: Stage, ids: list[str], exc: Exception
    ) -> None:
        """Reading the device's time of a stage over `ids` raised (an asynchronous device
        error, surfacing at the wait): whatever the stage made of them is suspect, so those
        still running here, or whose output is in `result`, fail with it."""
        what = f"{type(exc).__name__}: {exc}"
        logger.error("reading the device time of a %s of %s failed: %s", stage, ids, what)
        for request_id in ids:
            if states.pop(request_id, None) is not None or result.outputs.pop(request_id, None) is not None:
                result.errors[request_id] = exc

    def _cost(self, requests: list[GenerationRequest]) -> int:
        """The requests' step cost together, as the step scheduler counts it (rows of mixed
        sizes padded to one grid unless all pack: `engine.sched.step_fit.group_cost`), so the
        budget learnt from what fitted is in the units it bounds."""
        pipeline = self.pipeline
        return group_cost(
            _Costed(pipeline.step_cost(r), pipeline.step_grid(r), pipeline.step_packs(r)) for r in requests
        )

    def _fitted(self, result: BatchOutput, stage: Stage, cost: int) -> None:
        result.fits.append(StageFit(stage, cost))

    def _failed(self, result: BatchOutput, stage: Stage, ids: list[str], exc: Exception, cost: int) -> bool:
        """Note a stage that raised for `ids`; True if they are to be retried in halves, False
        if it was one request's own error (now in `result`)."""
        if is_out_of_memory(exc):
            result.fits.append(StageFit(stage, cost, out_of_memory=True))
        if len(ids) > 1:
            what = f"{type(exc).__name__}: {exc}"
            logger.warning("%s of %d requests failed (%s); retrying in halves", stage, len(ids), what)
            return True
        request_id = ids[0]
        if isinstance(exc, InvalidRequestError):  # the caller's input, said in the response
            logger.info("%s refused request %s: %s", stage, request_id, exc)
        else:
            logger.exception("%s failed for request %s", stage, request_id, exc_info=exc)
        result.errors[request_id] = exc
        return False


@dataclass(frozen=True, slots=True)
class _Costed:
    """A request's step cost, token grid and packing (`engine.sched.step_fit.Costed`)."""

    cost: int
    grid: tuple[int, ...]
    packs: bool
