"""Executors: the seam between the engine loop and the hardware.

An executor owns the pipeline and runs batches off the event loop. The engine loop does
not change when the executor does: `ThreadExecutor` here (a thread of the server), or
`engine.executor.process_executor.ProcessExecutor` (a worker process, shared memory).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.executor.abstract import ProgressListener
from engine.outputs import BatchOutput
from engine.request import PartialImage, RequestBatch
from engine.sched.step_plan import StepPlan
from engine.spec import PipelineSpec
from engine.worker.decoding import DecodeOverlap
from engine.worker.forward import run_batch
from engine.worker.profile_run import ProfilePlan, profile_at_start
from engine.worker.stepping import Flag, PartialListener, StepRunner

if TYPE_CHECKING:
    from pipelines.base import Pipeline, PipelineConfig


def load_configured(config: PipelineConfig, profile: ProfilePlan | None = None) -> Pipeline:
    """The configured pipeline, loaded here (a module-level function: a worker process can
    be told to call it), warmed up if its denoiser is compiled, then profiled as `profile`
    says: the result rides on the pipeline as `profile_result`, and its weights' bytes as
    `weight_bytes` (its `spec()` carries both to the engine's process)."""
    # Imported here so that importing the engine never imports torch.
    from pipelines.denoiser.warmup import warm_up
    from pipelines.memory.footprint import weight_bytes
    from pipelines.memory.profile import device_gauge, profile_target
    from pipelines.registry import load_pipeline

    pipeline = load_pipeline(config)
    # What keeping this model loaded costs, for residency among several models.
    pipeline.weight_bytes = weight_bytes(pipeline)  # type: ignore[attr-defined]
    # A compiled denoiser compiles its graphs now, on dummy requests, not in a user's request.
    warm_up(pipeline, config.denoiser)
    if profile is not None:
        gauge = device_gauge(config.device) if profile.gauge is None else profile.gauge(pipeline)
        result = profile_at_start(profile, config.device, profile_target(pipeline), gauge)
        pipeline.profile_result = result  # type: ignore[attr-defined]
    return pipeline


class ThreadExecutor:
    """Runs the pipeline in one dedicated thread of this process.

    One thread, always the same one, loads and calls the pipeline: diffusers pipelines
    keep per-run scheduler state and are unsafe to call from two threads at once.
    """

    def __init__(self, load: Callable[[], Pipeline], decode_overlap: DecodeOverlap = "off") -> None:
        self._load = load
        # Step-level batching: whether finished requests are decoded on a second thread
        # while the others go on stepping (`engine.worker.decoding`).
        self._decode_overlap = decode_overlap
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffbatch-executor")
        self._pipeline: Pipeline | None = None
        # Step-level batching: running requests' denoising states. Only the executor
        # thread touches it.
        self._steps: StepRunner | None = None
        self._on_partial: PartialListener | None = None
        # Where the weights were before a move to the host (`move_weights`): where they go back.
        self._weights_device = "cpu"

    @classmethod
    def for_config(
        cls, config: PipelineConfig, decode_overlap: DecodeOverlap = "off", profile: ProfilePlan | None = None
    ) -> ThreadExecutor:
        return cls(functools.partial(load_configured, config, profile), decode_overlap)

    async def start(
        self, on_progress: ProgressListener | None = None, on_partial: PartialListener | None = None
    ) -> PipelineSpec:
        loop = asyncio.get_running_loop()
        self._pipeline = await loop.run_in_executor(self._thread, self._load)
        if on_partial is not None:
            partial_listener = on_partial

            def deliver(partial: PartialImage) -> None:
                # Called in the executor thread, which goes on stepping; queued on the loop
                # ahead of the step's own result, so a preview never follows its image.
                loop.call_soon_threadsafe(partial_listener, partial)

            self._on_partial = deliver
        if on_progress is not None:
            listener = on_progress

            def report(request_ids: list[str], done: int, total: int) -> None:
                # Called in the executor thread; the listener runs on the event loop.
                loop.call_soon_threadsafe(listener, request_ids, done, total)

            self._pipeline.progress_callback = report
        return self._pipeline

    def new_flag(self) -> Flag:
        return threading.Event()

    def health(self) -> str | None:
        return None

    @property
    def step_runner(self) -> StepRunner | None:
        """The step-level runner, once the first step plan has come (for tests and metrics)."""
        return self._steps

    async def execute_batch(self, batch: RequestBatch, interrupt: Flag | None = None) -> BatchOutput:
        pipeline = self._pipeline
        if pipeline is None:
            raise RuntimeError("executor not started")

        def run() -> BatchOutput:
            pipeline.interrupt = interrupt  # type: ignore[assignment]  # a threading.Event here
            return run_batch(pipeline, batch)

        return await asyncio.get_running_loop().run_in_executor(self._thread, run)

    async def execute_step(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        if self._pipeline is None:
            raise RuntimeError("executor not started")
        if self._steps is None:
            self._steps = StepRunner(self._pipeline, self._on_partial, self._decode_overlap)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._steps.run, plan, attention)

    async def park_blocker(self) -> str | None:
        """Why the pipeline's weights cannot move to the host and back (`engine.models.host_parking`)."""
        from pipelines.memory.parking import park_blocker

        pipeline = self._pipeline
        if pipeline is None:
            return "not started"
        return await asyncio.get_running_loop().run_in_executor(self._thread, park_blocker, pipeline)

    async def move_weights(self, to_host: bool) -> None:
        """The pipeline's weights to host memory, or back to the device they were on, on the
        pipeline's own thread (never beside a forward)."""
        from pipelines.memory.parking import move_weights, weights_device

        pipeline = self._pipeline
        if pipeline is None:
            raise RuntimeError("executor not started")

        def move() -> None:
            if to_host:
                self._weights_device = weights_device(pipeline) or "cpu"
                move_weights(pipeline, "cpu")
            else:
                move_weights(pipeline, self._weights_device)

        await asyncio.get_running_loop().run_in_executor(self._thread, move)

    async def shutdown(self) -> None:
        # Let a forward already running finish, so its thread never outlives the model.
        await asyncio.to_thread(self._thread.shutdown, wait=True, cancel_futures=True)
        if self._steps is not None:
            await asyncio.to_thread(self._steps.close)
        if self._pipeline is not None:
            await asyncio.to_thread(self._pipeline.close)
        self._pipeline = None
        self._steps = None
