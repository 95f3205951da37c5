"""`EngineSpans`: an engine observer that turns each ended request's timeline
(`engine.timeline.RequestTimeline`) into spans, under the span its `traceparent` names (its
HTTP request's, perhaps in another process: the gateway of a Ray Serve replica).

One `engine` span per request, from its admission to its end, with what explains its time
as attributes (priority, batch or step groups, preemptions, the worker) and a child span
per stage: `queue wait`, then `forward` (request-level batching: one pipeline call), or
`prompt encode`, `denoise` and `decode` (step-level). The steps are one `denoise` span with
their count and group sizes, not a span each: a request of 50 steps would otherwise send 50.
The spans are made when the request ends, with the times the engine recorded, so the
engine and its workers run no tracing code at all.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.core.stats import QuietObserver
from engine.errors import RequestAbortedError
from engine.request import GenerationRequest
from engine.timeline import Interval, RequestTimeline

_W3C = TraceContextTextMapPropagator()
Attributes = dict[str, str | bool | int | float]


class MonotonicClock:
    """`time.monotonic()` readings as the epoch nanoseconds spans are stamped with, by the
    offset between the two clocks now."""

    def __init__(self) -> None:
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, monotonic: float) -> int:
        return int(monotonic * 1e9) + self._offset_ns


class EngineSpans(QuietObserver):
    def __init__(self, tracer: Tracer, replica: str | None = None) -> None:
        self._tracer = tracer
        self._replica = replica

    def on_request_end(
        self, request: GenerationRequest, timeline: RequestTimeline, error: Exception | None
    ) -> None:
        if request.traceparent is None:
            return  # not traced: not sampled, or not from an HTTP request
        parent = _W3C.extract({"traceparent": request.traceparent})
        clock = MonotonicClock()
        span = self._tracer.start_span(
            "engine",
            context=parent,
            start_time=clock.ns(timeline.admitted),
            attributes=self._attributes(request, timeline),
        )
        inside = trace.set_span_in_context(span)
        for name, interval, attributes in _stages(timeline):
            child = self._tracer.start_span(
                name, context=inside, start_time=clock.ns(interval.started), attributes=attributes
            )
            child.end(end_time=clock.ns(interval.ended))
        _outcome(span, error)
        span.end(end_time=clock.ns(timeline.ended if timeline.ended is not None else time.monotonic()))

    def _attributes(self, request: GenerationRequest, timeline: RequestTimeline) -> Attributes:
        params = request.params
        attributes: Attributes = {
            "diffbatch.request_id": request.request_id,
            "diffbatch.priority": params.priority,
            "diffbatch.images": params.n,
            "diffbatch.preemptions": timeline.preemptions,
            "diffbatch.retries": timeline.retries,
        }
        if params.num_inference_steps is not None:
            attributes["diffbatch.steps_asked"] = params.num_inference_steps
        if params.width is not None and params.height is not None:
            attributes["diffbatch.size"] = f"{params.width}x{params.height}"
        if params.lora is not None:
            attributes["diffbatch.lora"] = params.lora.name
        if timeline.worker is not None:
            attributes["diffbatch.worker"] = timeline.worker
        if self._replica is not None:
            attributes["diffbatch.replica"] = self._replica
        if timeline.batch_size:
            attributes["diffbatch.batch_size"] = timeline.batch_size
        return attributes

    # The rest of the observer: nothing to do.


def _stages(timeline: RequestTimeline) -> list[tuple[str, Interval, Attributes]]:
    """The child spans: each stage that ran, with the attributes that explain it."""
    stages: list[tuple[str, Interval, Attributes]] = []
    if timeline.scheduled is not None:
        stages.append(("queue wait", Interval(timeline.admitted, timeline.scheduled), {}))
    if timeline.forward is not None:
        stages.append(("forward", timeline.forward, {"diffbatch.batch_size": timeline.batch_size}))
    if timeline.prepare is not None:
        stages.append(("prompt encode", timeline.prepare, {}))
    steps = timeline.steps
    if steps is not None:
        attributes: Attributes = {
            "diffbatch.steps": steps.steps,
            "diffbatch.group_size.min": steps.smallest,
            "diffbatch.group_size.max": steps.largest,
            "diffbatch.group_size.mean": round(steps.mean_size, 3),
            "diffbatch.cache_blocks_skipped": steps.cache_blocks_skipped,
        }
        stages.append(("denoise", Interval(steps.started, steps.ended), attributes))
    if timeline.decode is not None:
        stages.append(("decode", timeline.decode, {"diffbatch.decode_size": timeline.decode_size}))
    return stages


def _outcome(span: Span, error: Exception | None) -> None:
    """An aborted request (its client went away, its deadline passed) is not the server's
    failure: said as an attribute; any other error marks the span failed."""
    if error is None:
        return
    if isinstance(error, RequestAbortedError):
        span.set_attribute("diffbatch.aborted", True)
        return
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
