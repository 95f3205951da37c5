"""`HostedPipeline`: what an executor needs of the pipeline it hosts — admission's answers
(`PipelineSpec`), a batched forward and the step-level stages (with the running counts read
around each: `PipelineCounters`, and the stages' `stage_timer`), progress and interruption,
a weightless copy for another process (`spec`), and `close`. Declared here so the engine
never imports `pipelines/`, and never asks a pipeline what it has: the server's composition
root (`server.composition`) loads a pipeline (`pipelines.base.Pipeline` is one, with a
default for each optional part) and hands it in, with how to measure it once loaded
(`Measure`: what the engine is told beside it, a `LoadReport`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.spec import PipelineSpec
from engine.worker.forward import ForwardPipeline
from engine.worker.profile_run import ProfileResult
from engine.worker.step_stages import StepPipeline

# Told, on the event loop, how far the running batch has got: (request ids, steps done, total).
ProgressListener = Callable[[list[str], int, int], None]


class HostedPipeline(PipelineSpec, ForwardPipeline, StepPipeline, Protocol):
    # Called from the pipeline's thread as a batch's denoising steps go by.
    progress_callback: ProgressListener | None
    # Set to stop a request-level forward at its next denoising step.
    interrupt: threading.Event | None

    def spec(self) -> PipelineSpec:
        """Its pure calls without its weights, picklable: what a worker process sends the
        engine's process, which admits requests with it."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What the composition root measured of a pipeline once it loaded, for the engine: its
    weights' bytes (what keeping the model loaded costs, for residency among several models;
    0: not measured) and what the profile run found (`engine.worker.profile_run`; None: none
    was asked for). Picklable: a worker process sends it with its `spec`."""

    weight_bytes: int = 0
    profile: ProfileResult | None = None


# Measures a pipeline where it has just loaded (its thread, or its worker process: then it
# must be picklable).
Measure = Callable[[HostedPipeline], LoadReport]
