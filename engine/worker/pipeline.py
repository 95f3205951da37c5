"""`HostedPipeline`: what an executor needs of the pipeline it hosts — admission's answers
(`PipelineSpec`), a batched forward, the step-level stages, progress and interruption, and
`close`. Declared here so the engine never imports `pipelines/`: the server's composition
root (`server.composition`) loads a pipeline (`pipelines.base.Pipeline` is one) and hands
it in."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from engine.request import GenerationRequest, RequestBatch, RequestOutput
from engine.spec import PipelineSpec

# Told, on the event loop, how far the running batch has got: (request ids, steps done, total).
ProgressListener = Callable[[list[str], int, int], None]


class HostedPipeline(PipelineSpec, Protocol):
    # Called from the pipeline's thread as a batch's denoising steps go by.
    progress_callback: ProgressListener | None
    # Set to stop a request-level forward at its next denoising step.
    interrupt: threading.Event | None

    def forward(self, batch: RequestBatch) -> list[RequestOutput]: ...

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]: ...

    def step(self, states: list[Any]) -> None: ...

    def finish(self, states: list[Any]) -> list[RequestOutput]: ...

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]: ...

    def close(self) -> None: ...
