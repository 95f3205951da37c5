"""Fake pipelines whose work takes a fixed time whatever the batch (up to `max_num_seqs`), for
`--pipeline-class`: a benchmark of scheduling policy (`bench.fair_share`) measures the
server's order, not the machine's load, in the service time.

`DIFFBATCH_FIXED_TIME_SCALE` stretches every time; `DIFFBATCH_FIXED_TIME_ROW_S` adds that
many seconds (also scaled) per row to a step group's step, for a device whose step grows
with its rows as a CPU's does (0 by default: a step takes the same time whatever its rows)."""

from __future__ import annotations

import os
import time
from typing import Any

from engine.request import RequestBatch, RequestOutput
from tests.engine.fakes import FakeStepPipeline
from tests.server.conftest import ImageFakePipeline

# Slower work (a larger scale) leaves the host's HTTP handling a smaller share of latency.
_SCALE = float(os.environ.get("DIFFBATCH_FIXED_TIME_SCALE", "1"))
FORWARD_S = 0.2 * _SCALE  # one request-level forward: its batch's every step
STEP_S = 0.05 * _SCALE  # one step of a step group
ROW_S = float(os.environ.get("DIFFBATCH_FIXED_TIME_ROW_S", "0")) * _SCALE  # added per row


class FixedTimeImages(ImageFakePipeline):
    """Request-level: each forward takes FORWARD_S."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        time.sleep(FORWARD_S)
        return super().forward(batch)


class FixedTimeSteps(FakeStepPipeline):
    """Step-level: each step of a group takes STEP_S; images as `ImageFakePipeline`'s."""

    resolve = ImageFakePipeline.resolve

    def step(self, states: list[Any]) -> None:
        time.sleep(STEP_S + ROW_S * len(states))
        super().step(states)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        outputs = super().finish(states)
        return [
            RequestOutput(
                request_id=o.request_id,
                images=tuple(ImageFakePipeline._image(s.request.params, seed) for seed in o.seeds),
                seeds=o.seeds,
            )
            for s, o in zip(states, outputs, strict=True)
        ]
