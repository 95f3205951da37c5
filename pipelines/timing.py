"""Timing stages on an accelerator: CUDA events, the device side of `engine.worker.timing`.

A stage's kernels run after its call returns, so its time is taken on the stream itself:
an event recorded before its first launch and one after its last, whose difference the
device measures. Reading it needs the device to have got past the end event; `ready()`
asks (`cudaEventQuery`, no wait) and `seconds()` waits on that event alone, never on the
whole device, so a reader that asks first adds no synchronisation to the stages.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch


class CudaTimer:
    """Spans of CUDA events on `device`'s current stream. `cuda` is `torch.cuda` (a test
    passes a fake device that records what was called)."""

    def __init__(self, device: torch.device, cuda: ModuleType | Any = torch.cuda) -> None:
        self.device = device
        self.cuda = cuda

    def start(self) -> CudaSpan:
        return CudaSpan(self.cuda, self.cuda.current_stream(self.device))


class CudaSpan:
    def __init__(self, cuda: Any, stream: Any) -> None:
        self.stream = stream
        self.begin = cuda.Event(enable_timing=True)
        self.end = cuda.Event(enable_timing=True)
        self.begin.record(stream)

    def stop(self) -> None:
        self.end.record(self.stream)

    def ready(self) -> bool:
        return bool(self.end.query())

    def seconds(self) -> float:
        self.end.synchronize()
        return float(self.begin.elapsed_time(self.end)) / 1000.0  # milliseconds


def device_timer(device: torch.device) -> CudaTimer | None:
    """The stage timer for `device`: CUDA events on a CUDA device; None elsewhere, where the
    host's clock is right (torch on the CPU runs each call to its end)."""
    return CudaTimer(device) if device.type == "cuda" else None
