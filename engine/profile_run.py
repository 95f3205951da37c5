"""The profile run at start (issue 25 item 5), as vLLM does before it serves: run one step
group at the step budget and one decode at the decode budget on dummy inputs, read the
device's peak memory, and halve each budget until its run fits within
`--gpu-memory-utilization` of the device's memory.

The search is written against `MemoryGauge` so tests drive it with a fake device;
`pipelines.memory.gauge.CudaGauge`
is the real one (torch imported only there: the engine does not import torch). NOT WIRED
YET: no flag (`--profile-run auto|on|off`), no call at start, nothing in /metrics or
/health; `should_profile` is the rule the flag is meant to follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.forward import is_out_of_memory

ProfileMode = Literal["auto", "on", "off"]


class MemoryGauge(Protocol):
    def capacity(self) -> int:
        """The device's memory, bytes."""
        ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int:
        """The most memory held since `reset_peak`, bytes."""
        ...


class ProfileError(RuntimeError):
    """Even a budget of 1 does not fit."""


@dataclass(frozen=True)
class Fitted:
    """A budget that fits, and the peak its run reached (bytes)."""

    budget: int
    peak: int


def should_profile(mode: ProfileMode, device: str) -> bool:
    """`auto` profiles on an accelerator only (on the CPU the run would cost minutes and
    the host's memory is not the server's alone to divide)."""
    return mode == "on" or (mode == "auto" and not device.startswith("cpu"))


def fit_budget(
    name: str, run: Callable[[int], None], budget: int, gauge: MemoryGauge, utilization: float
) -> Fitted:
    """The largest of `budget`, `budget // 2`, ... down to 1 whose run peaks within
    `utilization` of the device's memory; a run that runs out of memory does not fit.
    Halving, not a proportional guess: the fixed part of the peak (weights, the runtime)
    is unknown, so a smaller budget's peak is not a fraction of this one's."""
    limit = int(gauge.capacity() * utilization)
    while True:
        gauge.reset_peak()
        try:
            run(budget)
            peak: int | None = gauge.peak()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            peak = None
        if peak is not None and peak <= limit:
            return Fitted(budget, peak)
        if budget == 1:
            held = "ran out of memory" if peak is None else f"peaked at {peak} bytes"
            raise ProfileError(f"{name}: a budget of 1 {held}; the limit is {limit} bytes")
        budget //= 2
