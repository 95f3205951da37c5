"""The direct contender: the limit. The served pipeline, loaded in this process, runs the
requests grouped by batch key into full batches (the engine's own scheduler with
everything waiting at once) back to back, with no HTTP, no queueing and no encoding
(`bench.contenders` says more)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from bench.contenders import Load, Pictures, RoundResult, input_image
from bench.drivers import Sample
from bench.workload import RequestSpec


class DirectContender:
    """The served pipeline, loaded in this process and called with whole batches."""

    draws_previews = False

    def __init__(
        self, pipeline: Any, max_num_seqs: int, name: str = "direct", *, flush_denormal: bool = True
    ) -> None:
        self.pipeline = pipeline
        self.max_num_seqs = max_num_seqs
        self.name = name
        # As a server's pipeline thread: subnormals flushed to zero (`pipelines.float_modes`).
        self.flush_denormal = flush_denormal

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
        # Imported here: only the direct contender needs the engine's batching parts.
        from engine.sched.scheduler import Scheduler
        from engine.worker.forward import run_batch
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
            output = run_batch(pipeline, batch)
            scheduler.finish(batch)
            seconds = sum(record.seconds for record in output.forwards)
            for request in batch.requests:
                result = output.outputs.get(request.request_id)
                error = output.errors.get(request.request_id)
                if drawn is not None and result is not None:
                    drawn[index[request.request_id]] = result.images[0]
                samples.append(
                    Sample(
                        index[request.request_id],
                        clock,
                        clock + seconds,
                        ok=result is not None,
                        outputs=len(result.images) if result is not None else 0,
                        error=None if error is None else f"{type(error).__name__}: {error}",
                    )
                )
            clock += seconds
        return RoundResult(samples, clock)

    def _request(self, spec: RequestSpec) -> Any:
        from engine.request import GenerationRequest, SamplingParams

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
        request = GenerationRequest.create(spec.prompt, params, input_images=inputs)
        params = self.pipeline.resolve(request)
        self.pipeline.validate(params)
        return request.with_params(params)
