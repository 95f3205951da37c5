"""Counters the engine keeps about its own work, for logs, tests and metrics."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import BatchOutput, DecodeRecord, ForwardRecord, ModerationRecord
from engine.request import GenerationRequest, RequestBatch
from engine.timeline import RequestTimeline

# Weight of the newest forward in the running means used for Retry-After estimates.
_EMA_WEIGHT = 0.2


class EngineObserver(Protocol):
    """Told what the engine does, as it happens (metrics implement this)."""

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        """A batch leaves the queue; `now - request.arrival_time` is each one's queue wait."""

    def on_forward(self, record: ForwardRecord) -> None: ...

    def on_decode(self, record: DecodeRecord) -> None:
        """Step-level batching decoded requests that finished denoising, together."""

    def on_abort(self, request_id: str) -> None: ...

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        """The running batch finished denoising step `done` of `total`."""

    def on_request_end(
        self, request: GenerationRequest, timeline: RequestTimeline, error: Exception | None
    ) -> None:
        """A request ended (its result, or `error`: refused late, failed, aborted); `timeline`
        is what its time went to (traces)."""

    def on_moderation(self, record: ModerationRecord) -> None:
        """The safety checker checked images or previews (`engine.worker.moderation`)."""


class QuietObserver:
    """An `EngineObserver` that hears nothing: an observer that cares for a few events takes
    it as its base and overrides those, instead of spelling out every other one as `pass`."""

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        return None

    def on_forward(self, record: ForwardRecord) -> None:
        return None

    def on_decode(self, record: DecodeRecord) -> None:
        return None

    def on_abort(self, request_id: str) -> None:
        return None

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        return None

    def on_request_end(
        self, request: GenerationRequest, timeline: RequestTimeline, error: Exception | None
    ) -> None:
        return None

    def on_moderation(self, record: ModerationRecord) -> None:
        return None


class Observers:
    """The engine's observers told as one: its collaborators tell this object, and every
    observer in `observers` hears (the list may grow, or be replaced, at any time: a model
    set gives each model's engine its one list)."""

    def __init__(self) -> None:
        self.observers: list[EngineObserver] = []

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        for observer in self.observers:
            observer.on_batch_start(batch, now)

    def on_forward(self, record: ForwardRecord) -> None:
        for observer in self.observers:
            observer.on_forward(record)

    def on_decode(self, record: DecodeRecord) -> None:
        for observer in self.observers:
            observer.on_decode(record)

    def on_abort(self, request_id: str) -> None:
        for observer in self.observers:
            observer.on_abort(request_id)

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        for observer in self.observers:
            observer.on_progress(request_ids, done, total)

    def on_request_end(
        self, request: GenerationRequest, timeline: RequestTimeline, error: Exception | None
    ) -> None:
        for observer in self.observers:
            observer.on_request_end(request, timeline, error)

    def on_moderation(self, record: ModerationRecord) -> None:
        for observer in self.observers:
            observer.on_moderation(record)


# Recent units of work kept for tests, benchmarks and logs of when each worker was busy.
_SPANS_KEPT = 1024


@dataclass(frozen=True, slots=True)
class WorkSpan:
    """One unit of work (a batch, or a step iteration) on one worker, in `time.monotonic()`."""

    worker: int
    started: float
    ended: float
    num_requests: int


@dataclass(slots=True)
class EngineStats:
    requests_finished: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    num_forwards: int = 0
    # How many forwards carried k requests, for each k.
    forward_sizes: Counter[int] = field(default_factory=Counter)
    # How many step-level decodes carried k requests, for each k.
    decode_sizes: Counter[int] = field(default_factory=Counter)
    # Running means over forwards that ran to their end, for Retry-After
    # (`engine.core.admission.retry_after_s`): seconds per denoising step of one forward (a
    # request-level forward's time over its steps; a step-level forward is one step), and
    # requests per forward (how many requests each such step advances).
    mean_step_s: float = 0.0
    mean_step_requests: float = 0.0
    spans: deque[WorkSpan] = field(default_factory=lambda: deque(maxlen=_SPANS_KEPT))
    # Out-of-memory errors handled by retrying in halves without lowering a cap or budget,
    # by where: "prepare" and "finish" (step-level stages), "decode" (halved inside the VAE,
    # both modes). Forwards and steps that ran out are `ForwardRecord.out_of_memory`.
    out_of_memory: Counter[str] = field(default_factory=Counter)
    # Each worker's prompt-cache counts, the latest its results brought (cumulative there).
    prompt_cache: dict[int, dict[str, float]] = field(default_factory=dict)
    # Graphs torch.compile compiled during forwards, after the warm-up at start.
    compiles: int = 0

    def record_span(self, span: WorkSpan) -> None:
        self.spans.append(span)

    def record_out_of_memory(self, output: BatchOutput) -> None:
        for fit in output.fits:
            if fit.out_of_memory and fit.stage != "step":
                self.out_of_memory[fit.stage] += 1
        if output.decode_out_of_memory:
            self.out_of_memory["decode"] += output.decode_out_of_memory

    def record_prompt_cache(self, worker: int, output: BatchOutput) -> None:
        if output.prompt_cache is not None:
            self.prompt_cache[worker] = output.prompt_cache

    def prompt_cache_totals(self) -> dict[str, float]:
        """Every worker's prompt-cache counts added up (empty without a prompt cache)."""
        totals: dict[str, float] = {}
        for counts in self.prompt_cache.values():
            for name, value in counts.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def record_decodes(self, decodes: list[DecodeRecord]) -> None:
        for record in decodes:
            self.decode_sizes[record.num_requests] += 1

    def record_forwards(self, forwards: list[ForwardRecord]) -> None:
        for record in forwards:
            self.num_forwards += 1
            self.forward_sizes[record.num_requests] += 1
            self.compiles += record.compiles
            if not record.ok or record.interrupted or record.shared:
                # A failed or cut-short forward says little about a step's cost, nor does one
                # that shared the device with a decode.
                continue
            self.mean_step_s = _running_mean(self.mean_step_s, record.seconds / max(1, record.steps))
            self.mean_step_requests = _running_mean(self.mean_step_requests, record.num_requests)


def _running_mean(mean: float, value: float) -> float:
    return value if mean == 0.0 else mean + _EMA_WEIGHT * (value - mean)
