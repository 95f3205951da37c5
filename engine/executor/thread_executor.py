"""Executors: the seam between the engine loop and the hardware.

An executor owns the pipeline and runs batches off the event loop. The engine loop does
not change when the executor does: `ThreadExecutor` here (a thread of the server), or
`engine.executor.process_executor.ProcessExecutor` (a worker process, shared memory).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from engine.executor.abstract import Loaded
from engine.outputs import BatchOutput
from engine.request import PartialImage, RequestBatch
from engine.sched.step_plan import StepPlan
from engine.worker.decoding import DecodeOverlap
from engine.worker.forward import run_batch
from engine.worker.pipeline import HostedPipeline, LoadReport, Measure, ProgressListener
from engine.worker.stepping import Flag, PartialListener, StepRunner


class WeightParking(Protocol):
    """Moving a pipeline's weights to host memory and back (`engine.models.host_parking`),
    as the composition root that loaded it knows how."""

    def blocker(self, pipeline: HostedPipeline) -> str | None:
        """Why its weights cannot move to the host and back, or None."""
        ...

    def device(self, pipeline: HostedPipeline) -> str | None:
        """Where its weights are now."""
        ...

    def move(self, pipeline: HostedPipeline, device: str) -> None: ...


class ThreadExecutor:
    """Runs the pipeline in one dedicated thread of this process.

    One thread, always the same one, loads and calls the pipeline: diffusers pipelines
    keep per-run scheduler state and are unsafe to call from two threads at once. There,
    once loaded, `measure` (if given) says what the engine is told of it (`LoadReport`).
    """

    def __init__(
        self,
        load: Callable[[], HostedPipeline],
        decode_overlap: DecodeOverlap = "off",
        parking: WeightParking | None = None,
        measure: Measure | None = None,
    ) -> None:
        self._load = load
        self._measure = measure
        # How its weights move to the host and back (None: they cannot, the model is dropped).
        self._parking = parking
        # Step-level batching: whether finished requests are decoded on a second thread
        # while the others go on stepping (`engine.worker.decoding`).
        self._decode_overlap = decode_overlap
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffbatch-executor")
        self._pipeline: HostedPipeline | None = None
        # Step-level batching: running requests' denoising states. Only the executor
        # thread touches it.
        self._steps: StepRunner | None = None
        self._on_partial: PartialListener | None = None
        # Where the weights were before a move to the host (`move_weights`): where they go back.
        self._weights_device = "cpu"

    async def start(
        self, on_progress: ProgressListener | None = None, on_partial: PartialListener | None = None
    ) -> Loaded:
        loop = asyncio.get_running_loop()
        pipeline, measured = await loop.run_in_executor(self._thread, self._load_and_measure)
        self._pipeline = pipeline
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

            pipeline.progress_callback = report
        return Loaded(pipeline, measured)

    def _load_and_measure(self) -> tuple[HostedPipeline, LoadReport]:
        pipeline = self._load()
        return pipeline, LoadReport() if self._measure is None else self._measure(pipeline)

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
        pipeline, parking = self._pipeline, self._parking
        if pipeline is None:
            return "not started"
        if parking is None:
            return "this executor was given no way to move its weights"
        return await asyncio.get_running_loop().run_in_executor(self._thread, parking.blocker, pipeline)

    async def move_weights(self, to_host: bool) -> None:
        """The pipeline's weights to host memory, or back to the device they were on, on the
        pipeline's own thread (never beside a forward)."""
        pipeline, parking = self._pipeline, self._parking
        if pipeline is None or parking is None:
            raise RuntimeError("executor not started, or its weights cannot move")

        def move() -> None:
            if to_host:
                self._weights_device = parking.device(pipeline) or "cpu"
                parking.move(pipeline, "cpu")
            else:
                parking.move(pipeline, self._weights_device)

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
