"""`Executor`: the seam between the engine loop and the hardware. An executor owns the
pipeline and runs work off the event loop; the engine loop does not change when the
executor does (`ThreadExecutor`: a thread of this process; `ProcessExecutor`: worker
processes, shared memory)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import BatchOutput
from engine.request import RequestBatch
from engine.sched.step_plan import StepPlan
from engine.spec import PipelineSpec
from engine.worker.pipeline import LoadReport, ProgressListener
from engine.worker.stepping import Flag, PartialListener


@dataclass(frozen=True, slots=True)
class Loaded:
    """What an executor's `start` hands the engine: the pipeline's pure calls, to admit
    requests with (`spec`), and what the composition root measured of it as it loaded
    (`report`: its weights' bytes, the profile run)."""

    spec: PipelineSpec
    report: LoadReport = field(default_factory=LoadReport)


class Executor(Protocol):
    def new_flag(self) -> Flag:
        """A flag for `execute_batch`'s interrupt or `execute_step`'s attention, made before
        `start` (a worker process is given its flags when it starts)."""
        ...

    def health(self) -> str | None:
        """None while the executor can run work, else why it cannot (a worker restarting)."""
        ...

    async def start(
        self, on_progress: ProgressListener | None = None, on_partial: PartialListener | None = None
    ) -> Loaded:
        """Load the pipeline; return what the engine needs to admit requests, and what was
        measured of it as it loaded. The listeners
        are called on the event loop: progress of a running batch, and each preview
        (`partial_images`) as soon as it is decoded."""
        ...

    async def execute_batch(self, batch: RequestBatch, interrupt: Flag | None = None) -> BatchOutput:
        """One batched forward; if `interrupt` is set meanwhile, the forward stops at its
        next denoising step and its requests end aborted."""
        ...

    async def execute_step(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        """One iteration of step-level batching (more steps of the same group while
        `attention` stays clear); the executor keeps each request's state."""
        ...

    async def shutdown(self) -> None: ...
