"""`RequestTimeline`: what one request's time went to in the engine, as the engine saw it —
its queue wait, the stages that ran it and why they took what they took (its batch or step
groups, its preemptions). Plain data, recorded for every request (a few numbers each) from
what the executor already reports (`engine.outputs`); the server turns it into trace spans
when the request ends (`server.tracing`), so the engine depends on no tracing library.

Times are `time.monotonic()` readings of the process the engine runs in; a worker process's
readings are on the same clock (Linux's monotonic clock is the machine's, not the process's).
A stage's start is the host's reading when it was issued and its length what the executor
timed (on its device, `engine.worker.timing`): on an accelerator, which runs what the host
issued later, a stage may show earlier than its kernels ran and overlap the next a little.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Interval:
    started: float
    ended: float


@dataclass(slots=True)
class StepGroups:
    """The denoising steps a request took in step-level batching, one record for them all:
    how many, from the first's start to the last's end, the sizes (in requests) of the groups
    it stepped in, and the denoiser blocks those groups skipped under cache acceleration (a
    group's count: requests that stepped together share it)."""

    started: float
    ended: float
    steps: int = 0
    smallest: int = 0
    largest: int = 0
    requests: int = 0  # the groups' sizes added up: `requests / steps` is the mean size
    cache_blocks_skipped: int = 0

    def add(self, started: float, ended: float, size: int, cache_blocks_skipped: int) -> None:
        self.started = min(self.started, started)
        self.ended = max(self.ended, ended)
        self.smallest = size if self.steps == 0 else min(self.smallest, size)
        self.largest = max(self.largest, size)
        self.steps += 1
        self.requests += size
        self.cache_blocks_skipped += cache_blocks_skipped

    @property
    def mean_size(self) -> float:
        return self.requests / self.steps if self.steps else 0.0


@dataclass(slots=True)
class RequestTimeline:
    """One request from its admission (`admitted`) to its end (`ended`). `scheduled` is when
    it left the queue: its batch started (request-level batching) or it first joined a step
    group (step-level). Request-level batching runs it in one pipeline call (`forward`, with
    `batch_size` requests); step-level in stages: `prepare` (prompt encoded, latents drawn),
    `steps`, `decode` (with `decode_size` requests). A stage retried (in halves after a
    failure, or on another worker after a crash) shows its last run; `retries` counts the
    requests' runs on another worker."""

    admitted: float
    scheduled: float | None = None
    ended: float | None = None
    worker: int | None = None
    forward: Interval | None = None
    batch_size: int = 0
    prepare: Interval | None = None
    steps: StepGroups | None = None
    decode: Interval | None = None
    decode_size: int = 0
    preemptions: int = 0
    retries: int = 0

    def add_step(self, started: float, ended: float, size: int, cache_blocks_skipped: int) -> None:
        if self.steps is None:
            self.steps = StepGroups(started, ended)
        self.steps.add(started, ended, size, cache_blocks_skipped)
