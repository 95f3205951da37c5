"""CUDA event spans (`pipelines.timing`), on a fake `torch.cuda` that records what was
called: events on the stage's stream, and the host waits only to read a span, on its end
event alone."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pipelines.timing import CudaTimer, device_timer


class FakeEvent:
    """A CUDA event whose device timestamp (`ms`) the test sets."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
        assert enable_timing
        self.cuda = cuda
        self.name = f"event{len(cuda.events)}"
        self.ms = 0.0
        cuda.events.append(self)

    def record(self, stream: Any) -> None:
        self.cuda.calls.append(("record", self.name, stream))

    def query(self) -> bool:
        self.cuda.calls.append(("query", self.name))
        return False

    def synchronize(self) -> None:
        self.cuda.calls.append(("synchronize", self.name))

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms


class FakeCuda:
    """Stands in for `torch.cuda`, recording every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.events: list[FakeEvent] = []
        self.Event = functools.partial(FakeEvent, self)

    def current_stream(self, device: torch.device) -> str:
        self.calls.append(("current_stream", str(device)))
        return "stream"

    def synchronize(self, device: Any = None) -> None:  # what a span must never call
        self.calls.append(("device synchronize",))


def test_a_span_records_events_on_the_stream_and_waits_only_to_be_read() -> None:
    cuda = FakeCuda()
    span = CudaTimer(torch.device("cuda", 0), cuda).start()
    span.stop()
    begin, end = cuda.events
    assert cuda.calls == [
        ("current_stream", "cuda:0"),
        ("record", begin.name, "stream"),
        ("record", end.name, "stream"),
    ]
    assert span.ready() is False and cuda.calls[-1] == ("query", end.name)
    begin.ms, end.ms = 1000.0, 1250.0
    assert span.seconds() == 0.25
    assert ("synchronize", end.name) in cuda.calls and ("device synchronize",) not in cuda.calls


def test_the_cpu_is_timed_by_the_host_clock() -> None:
    assert device_timer(torch.device("cpu")) is None
    assert isinstance(device_timer(torch.device("cuda", 1)), CudaTimer)
