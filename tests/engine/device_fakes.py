"""A fake accelerator for timing tests: work launched on it runs only when the host waits
for it, and it records every question the host asks (no torch, no GPU)."""

from __future__ import annotations

from typing import Any

from engine.request import RequestOutput
from tests.engine.fakes import FakeStepPipeline


class FakeDevice:
    """Runs its queue in order, only as far as the host waits (`synchronize`), in device
    seconds of its own. `calls` logs what the host asked: "query" (no wait) and
    "synchronize" (a wait), with the stages' own entries between."""

    def __init__(self) -> None:
        self.durations: list[float] = []  # every launch, in order
        self.ran = 0  # launches done
        self.calls: list[str] = []
        # Raised by every question about a span from now on (a CUDA error surfaces there).
        self.fault: Exception | None = None

    def launch(self, seconds: float) -> None:
        self.durations.append(seconds)

    def run_to(self, launches: int) -> None:
        self.ran = max(self.ran, launches)

    def synchronize(self) -> None:
        """The host waits for everything queued (a copy of results to the host)."""
        self.calls.append("synchronize")
        self.run_to(len(self.durations))

    def stage_timer(self) -> FakeDeviceTimer:
        return FakeDeviceTimer(self)


class FakeEvent:
    """A point in the device's queue: reached once the launches before it have run."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.after = len(device.durations)

    @property
    def time(self) -> float:
        return sum(self.device.durations[: self.after])


class FakeSpan:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.begin = FakeEvent(device)
        self.end: FakeEvent | None = None

    def stop(self) -> None:
        self.end = FakeEvent(self.device)

    def ready(self) -> bool:
        self.device.calls.append("query")
        if self.device.fault is not None:
            raise self.device.fault
        assert self.end is not None
        return self.device.ran >= self.end.after

    def seconds(self) -> float:
        if self.device.fault is not None:
            raise self.device.fault
        assert self.end is not None
        if self.device.ran < self.end.after:
            self.device.calls.append("synchronize")
            self.device.run_to(self.end.after)
        return self.end.time - self.begin.time


class FakeDeviceTimer:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def start(self) -> FakeSpan:
        return FakeSpan(self.device)


class FakeDeviceStepPipeline(FakeStepPipeline):
    """A stepping pipeline on a `FakeDevice`: a step launches `step_s` of work and returns at
    once; a decode launches `decode_s` per image and waits for the device, as a copy of its
    images to the host does."""

    def __init__(self, device: FakeDevice, step_s: float, decode_s: float) -> None:
        super().__init__()
        self.device = device
        self.step_s = step_s
        self.decode_s = decode_s

    def stage_timer(self) -> FakeDeviceTimer:
        return self.device.stage_timer()

    def step(self, states: list[Any]) -> None:
        super().step(states)
        self.device.launch(self.step_s)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        self.device.calls.append("finish")
        self.device.launch(self.decode_s * sum(s.num_images for s in states))
        self.device.synchronize()
        return super().finish(states)
