"""The direct contender: the limit. The served pipeline, loaded in this process, runs the
requests grouped by batch key into full batches (the engine's own scheduler with
everything waiting at once) back to back, with no HTTP, no queueing and no encoding
(`bench.contenders` says more). `direct` makes each batch one request-level forward (the
adapter's diffusers call); `direct-step` steps it with the step-batching adapter, the
engine's own `StepRunner`, every request joining at once; `bench.raw_diffusers` calls the
diffusers pipeline itself."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from bench.contenders import Load, Pictures, RoundResult, control_image, input_image
from bench.drivers import Sample
from bench.workload import RequestSpec

# How a direct contender runs one batch: one request-level forward, or step by step.
Batching = Literal["request", "step"]


@dataclass(slots=True)
class BatchRun:
    """One batch run to its end: its seconds, each request's images, each failure."""

    seconds: float
    images: dict[str, list[np.ndarray]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class DirectContender:
    """The served pipeline, loaded in this process and called with whole batches."""

    draws_previews = False

    def __init__(
        self,
        pipeline: Any,
        max_num_seqs: int,
        name: str = "direct",
        *,
        flush_denormal: bool = True,
        batching: Batching = "request",
    ) -> None:
        self.pipeline = pipeline
        self.max_num_seqs = max_num_seqs
        self.name = name
        # As a server's pipeline thread: subnormals flushed to zero (`pipelines.float_modes`).
        self.flush_denormal = flush_denormal
        self.batching = batching

    async def run(self, load: Load, specs: list[RequestSpec]) -> RoundResult:
        offered = self.max_num_seqs if load.kind == "poisson" else int(load.level)
        return await asyncio.to_thread(self.run_all, specs, min(offered, self.max_num_seqs))

    async def pictures(self, specs: list[RequestSpec], concurrency: int) -> Pictures:
        drawn: dict[int, np.ndarray] = {}
        result = await asyncio.to_thread(self.run_all, specs, min(concurrency, self.max_num_seqs), drawn)
        error = next((s.error for s in result.samples if s.error), None)
        return Pictures([drawn.get(i) for i in range(len(specs))], error)

    def run_all(
        self, specs: list[RequestSpec], max_num_seqs: int, drawn: dict[int, np.ndarray] | None = None
    ) -> RoundResult:
        """Run `specs` in full batches; with `drawn`, keep each request's first picture there."""
        # Imported here: only the direct contenders need the engine's batching parts.
        from engine.sched.scheduler import Scheduler
        from pipelines.float_modes import flush_denormals

        # Each call may come on another thread of asyncio's pool: the setting is per thread.
        flush_denormals(self.flush_denormal)
        pipeline = self.pipeline
        scheduler = Scheduler(max_num_seqs, None if pipeline.supports_request_batch else 1)
        index: dict[str, int] = {}
        for i, spec in enumerate(specs):
            request = self._request(spec)
            scheduler.add(request, pipeline.batch_key(request))
            index[request.request_id] = i
        clock, samples = 0.0, []
        while (batch := scheduler.next_batch()) is not None:
            run = self.run_batch(batch)
            scheduler.finish(batch)
            seconds = run.seconds
            for request in batch.requests:
                images = run.images.get(request.request_id)
                if drawn is not None and images:
                    drawn[index[request.request_id]] = images[0]
                samples.append(
                    Sample(
                        index[request.request_id],
                        clock,
                        clock + seconds,
                        ok=images is not None,
                        outputs=len(images) if images is not None else 0,
                        error=run.errors.get(request.request_id),
                    )
                )
            clock += seconds
        return RoundResult(samples, clock)

    def run_batch(self, batch: Any) -> BatchRun:
        """One batch (an `engine.request.RequestBatch`) through the adapter."""
        if self.batching == "step":
            return self._stepped(batch)
        from engine.worker.forward import run_batch

        output = run_batch(self.pipeline, batch)
        run = BatchRun(sum(record.seconds for record in output.forwards))
        run.images = {rid: list(result.images) for rid, result in output.outputs.items()}
        run.errors = {rid: f"{type(error).__name__}: {error}" for rid, error in output.errors.items()}
        return run

    def _stepped(self, batch: Any) -> BatchRun:
        """The batch stepped by the engine's own `StepRunner`, every request joining at once,
        until each is decoded. Its images are on the host at the end: the clock is right on
        an accelerator too."""
        from engine.sched.step_scheduler import StepScheduler
        from engine.worker.stepping import StepRunner

        pipeline = self.pipeline
        runner = StepRunner(pipeline)
        scheduler = StepScheduler(max_num_seqs=self.max_num_seqs)
        for request in batch.requests:
            scheduler.add(request, pipeline.step_key(request))
        run, left = BatchRun(0.0), len(batch.requests)
        # Never set: as in the engine with no news, the runner keeps stepping its group.
        quiet = threading.Event()
        start = time.perf_counter()
        try:
            while left and (plan := scheduler.schedule()) is not None:
                output = runner.run(plan, quiet)
                scheduler.release(output.decoding)
                left -= len(scheduler.finish([*output.outputs, *output.errors]))
                run.images |= {rid: list(result.images) for rid, result in output.outputs.items()}
                run.errors |= {rid: f"{type(e).__name__}: {e}" for rid, e in output.errors.items()}
        finally:
            runner.close()
        run.seconds = time.perf_counter() - start
        return run

    def _request(self, spec: RequestSpec) -> Any:
        from engine.request import ControlRef, GenerationRequest, SamplingParams

        video = spec.seconds is not None
        params = SamplingParams(
            width=spec.width,
            height=spec.height,
            num_inference_steps=spec.steps,
            guidance_scale=spec.guidance,
            seed=spec.seed,
            n=1 if video else spec.n,
            duration_s=spec.seconds,
            negative_prompt=spec.negative_prompt,
            strength=spec.strength,
        )
        inputs = (input_image(spec),) if self.pipeline.input_image_count[0] > 0 else ()
        controls = () if spec.controlnet is None else (ControlRef(spec.controlnet, control_image(spec)),)
        request = GenerationRequest.create(spec.prompt, params, input_images=inputs, controls=controls)
        params = self.pipeline.resolve(request)
        self.pipeline.validate(params)
        request = request.with_params(params)
        # Control images resized to the output, as admission reduces them before queueing.
        return self.pipeline.reduce_inputs(request) if controls else request
