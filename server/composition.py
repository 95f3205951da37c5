"""The composition root: a configured pipeline loaded, measured, warmed up and profiled, and
the executors that host it. The engine declares what it needs of a pipeline
(`engine.worker.pipeline.HostedPipeline`) and never imports `pipelines/`; this module joins
the two. `load_configured` is module-level so a worker process can be told to call it by
name with a picklable `PipelineConfig`; torch is imported only when it runs."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from engine.executor.process_executor import DEFAULT_START_TIMEOUT_S, ProcessExecutor
from engine.executor.thread_executor import ThreadExecutor
from engine.executor.worker_process import describe
from engine.worker.decoding import DecodeOverlap
from engine.worker.pipeline import HostedPipeline
from engine.worker.profile_run import ProfilePlan, profile_at_start

if TYPE_CHECKING:
    from pipelines.base import Pipeline, PipelineConfig


def load_configured(config: PipelineConfig, profile: ProfilePlan | None = None) -> Pipeline:
    """The configured pipeline, loaded here, warmed up if its denoiser is compiled, then
    profiled as `profile` says: the result rides on the pipeline as `profile_result`, and its
    weights' bytes as `weight_bytes` (its `spec()` carries both to the engine's process)."""
    # Imported here so that importing the server never imports torch.
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


class PipelineParking:
    """`WeightParking` through `pipelines.memory.parking` (diffusers' own device moves)."""

    def blocker(self, pipeline: HostedPipeline) -> str | None:
        from pipelines.memory.parking import park_blocker

        return park_blocker(pipeline)

    def device(self, pipeline: HostedPipeline) -> str | None:
        from pipelines.memory.parking import weights_device

        return weights_device(pipeline)

    def move(self, pipeline: HostedPipeline, device: str) -> None:
        from pipelines.memory.parking import move_weights

        move_weights(pipeline, device)


def thread_executor(
    config: PipelineConfig, decode_overlap: DecodeOverlap = "off", profile: ProfilePlan | None = None
) -> ThreadExecutor:
    """`config`'s pipeline in a thread of this process (its weights can be parked)."""
    return ThreadExecutor(
        functools.partial(load_configured, config, profile), decode_overlap, parking=PipelineParking()
    )


def process_executor(
    config: PipelineConfig,
    decode_overlap: DecodeOverlap = "off",
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    profile: ProfilePlan | None = None,
) -> ProcessExecutor:
    """`config`'s pipeline in a worker process, which calls `load_configured` itself."""
    loading = describe(config.model, config.device, config.pipeline_class)
    load = functools.partial(load_configured, config, profile)
    return ProcessExecutor(load, decode_overlap, start_timeout_s=start_timeout_s, loading=loading)
