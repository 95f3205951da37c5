"""Admission: a request's settings made whole and checked (`admitted`), the admission
wait: how long an idle engine may hold a batch open for more arrivals, and when a refused
caller should come back (`retry_after_s`).

The wait is pure arithmetic over times the caller passes in, so tests drive it with a
fake clock.

Waiting only pays when the executor is idle: while a batch runs, arrivals accumulate by
themselves. The window is measured from the oldest waiting request's arrival, so the
latency it adds to any request is at most `max_wait_s`, and a request that already
waited behind a running batch is not held again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.request import GenerationRequest, InvalidRequestError, draw_seed

if TYPE_CHECKING:
    from engine.spec import PipelineSpec

# Arrivals that stop for this long (or a fifth of the wait, if shorter) end the wait early:
# a burst of concurrent callers is over, and holding the batch open longer only adds latency.
MAX_QUIET_WINDOW_S = 0.050


@dataclass(frozen=True, slots=True)
class AdmissionWait:
    max_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.max_wait_s) or self.max_wait_s < 0:
            raise ValueError(
                f"request_batch_max_wait_ms must be a finite number >= 0, got {self.max_wait_s * 1000}"
            )

    @classmethod
    def from_ms(cls, max_wait_ms: float) -> AdmissionWait:
        return cls(max_wait_ms / 1000.0)

    @property
    def quiet_window_s(self) -> float:
        return min(MAX_QUIET_WINDOW_S, self.max_wait_s / 5)

    def remaining(
        self,
        now: float,
        *,
        num_running: int,
        batch_full: bool,
        head_arrival: float,
        last_arrival: float,
    ) -> float:
        """Seconds to keep waiting before forming the batch; 0 means form it now.

        `head_arrival` is when the oldest waiting request arrived; `last_arrival` when the
        newest request compatible with it did.
        """
        if self.max_wait_s == 0 or num_running > 0 or batch_full:
            return 0.0
        deadline = head_arrival + self.max_wait_s
        quiet_until = last_arrival + self.quiet_window_s
        return max(0.0, min(deadline, quiet_until) - now)


def admitted(spec: PipelineSpec, request: GenerationRequest) -> GenerationRequest:
    """`request` with the model's defaults filled in and a seed drawn once, or
    `InvalidRequestError` (400) naming the field. The same wherever the engine runs (a
    gateway checks before sending the request to a replica, which checks again)."""
    params = spec.resolve(request)
    if params.seed is None:
        params = replace(params, seed=draw_seed())
    spec.validate(params)
    spec.validate_inputs(len(request.input_images), request.mask is not None)
    if request.control_video is not None and not spec.accepts_control_video:
        raise InvalidRequestError("this model takes no control video (Wan VACE models do)", "video")
    if request.controls:
        spec.validate_controls(request.controls)
    if request.ip_adapters:
        spec.validate_ip_adapters(request.ip_adapters, params)
    return request.with_params(params)


def retry_after_s(*, steps_ahead: int, step_s: float, concurrency: float) -> float:
    """Seconds until the work ahead is done, for `Retry-After`: `steps_ahead` denoising
    steps of the requests the engine holds, `step_s` seconds per step of one forward,
    `concurrency` requests advancing per step (requests per forward times workers). In
    steps, so it means the same in both batching modes: a request-level forward carries
    all its steps, a step-level one a single step. At least 1 s (the header counts whole
    seconds), and 1 s before any forward has been timed."""
    if step_s <= 0 or concurrency <= 0:
        return 1.0
    return max(1.0, steps_ahead * step_s / concurrency)
