"""Timing pipeline stages on the device that runs them: the seam between the runner's
bookkeeping and an accelerator's clock.

An accelerator runs work asynchronously: a stage's call returns once its kernels are
queued, so `time.perf_counter` around it measures the launches, and whichever stage next
waits for the device (a decode copying images to the host) absorbs the queued work. So a
pipeline on such a device offers a `StageTimer` for it (its `stage_timer()`, part of the
contract: CUDA events in `pipelines/timing.py`), and the engine, which imports no torch,
sees only this Protocol. A pipeline that offers none (`stage_timer()` is None) has its
stages timed by `HostClock`: on the CPU torch runs each call to its end.

A `Span` is read once the device has got past its end: `ready()` asks without waiting,
`seconds()` waits. The runner reads spans where the device has caught up anyway (after a
decode, whose images reach the host) or asks without waiting, so timing adds no host
synchronisation to the steps (`engine.worker.stepping`).
"""

from __future__ import annotations

import time
from typing import Protocol


class Span(Protocol):
    """One stage's time on its device, from `StageTimer.start` to `stop`."""

    def stop(self) -> None:
        """Mark the stage's end (after its last call has been issued)."""
        ...

    def ready(self) -> bool:
        """Whether the device has got past the end, so `seconds` would not wait (never waits)."""
        ...

    def seconds(self) -> float:
        """The stage's time; waits for the device to get past the end if it has not yet."""
        ...


class StageTimer(Protocol):
    def start(self) -> Span:
        """Mark a stage's start (before its first call is issued)."""
        ...


class HostClock:
    """The host's clock, for devices that run each call to its end (the CPU)."""

    def start(self) -> ClockSpan:
        return ClockSpan(time.perf_counter())


class ClockSpan:
    def __init__(self, started: float) -> None:
        self.started = started
        self.ended: float | None = None

    def stop(self) -> None:
        self.ended = time.perf_counter()

    def ready(self) -> bool:
        return True

    def seconds(self) -> float:
        ended = self.ended if self.ended is not None else time.perf_counter()
        return ended - self.started
