"""The composition root: a configured pipeline loaded, warmed up, measured and profiled, and
the executors that host it. The engine declares what it needs of a pipeline
(`engine.worker.pipeline.HostedPipeline`) and never imports `pipelines/`; this module joins
the two. `load_configured` and `measure_loaded` are module-level so a worker process can be
told to call them by name with a picklable `PipelineConfig`; torch is imported only when
they run."""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from typing import TYPE_CHECKING

from engine.executor.lane_group import LaneGroupExecutor
from engine.executor.process_executor import DEFAULT_START_TIMEOUT_S, ProcessExecutor
from engine.executor.thread_executor import ThreadExecutor
from engine.executor.worker_process import describe
from engine.worker.decoding import DecodeOverlap
from engine.worker.pipeline import HostedPipeline, LoadReport
from engine.worker.profile_run import ProfilePlan, profile_at_start

if TYPE_CHECKING:
    from pipelines.base import Pipeline, PipelineConfig

logger = logging.getLogger(__name__)


def load_configured(config: PipelineConfig) -> Pipeline:
    """The configured pipeline, loaded here with its safety checker if the server has one,
    and warmed up if its denoiser is compiled. Here is the thread (or worker process) that will
    run it: subnormal floats are flushed to zero in it first, as `config.flush_denormal` says,
    so the threads it starts inherit that."""
    # Imported here so that importing the server never imports torch.
    from pipelines.denoiser.warmup import warm_up
    from pipelines.float_modes import flush_denormals
    from pipelines.registry import load_pipeline

    flush_denormals(config.flush_denormal)
    pipeline = load_pipeline(config)
    if config.safety_checker is not None:  # beside the pipeline, on its device (`pipelines.safety`)
        from pipelines.safety import load_safety_checker

        pipeline.safety_checker = load_safety_checker(config.safety_checker, config.device)
    # A compiled denoiser compiles its graphs now, on dummy requests, not in a user's request;
    # where a lane splits tokens the exchanges sit inside its blocks' attention, so it warms
    # up once joined, every member stepping the same dummy requests.
    split_tokens = config.lane is not None and config.lane.shape.sequence > 1
    if not split_tokens:
        warm_up(pipeline, config.denoiser)
    if config.lane is not None:  # a member of a lane of several devices meets the others
        from pipelines.parallel.lane_group import join_lane

        join_lane(pipeline, config.lane, config.device)
    if split_tokens:
        warm_up(pipeline, config.denoiser)
    return pipeline


def measure_loaded(
    config: PipelineConfig, profile: ProfilePlan | None, pipeline: HostedPipeline
) -> LoadReport:
    """What the engine is told of the pipeline `load_configured` loaded, measured where it
    lives (its executor carries it to the engine): its weights' bytes, what keeping the
    model loaded costs (residency among several models), and with `profile` what the
    profile run at start found."""
    from pipelines.memory.footprint import weight_bytes
    from pipelines.memory.profile import device_gauge, profile_target

    footprint = weight_bytes(pipeline)
    if profile is None:
        return LoadReport(footprint)
    gauge = device_gauge(config.device) if profile.gauge is None else profile.gauge(pipeline)
    if config.lane is not None:
        # Each member of a lane profiles its device alone, on every row of the dummy group
        # (its dummy requests are its own, so the members' steps would not agree): the
        # budgets it finds hold for the half it runs when shared.
        from pipelines.parallel.lane_group import alone

        with alone(pipeline):
            result = profile_at_start(profile, config.device, profile_target(pipeline), gauge)
        return LoadReport(footprint, result)
    return LoadReport(footprint, profile_at_start(profile, config.device, profile_target(pipeline), gauge))


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
    load = functools.partial(load_configured, config)
    measure = functools.partial(measure_loaded, config, profile)
    return ThreadExecutor(load, decode_overlap, parking=PipelineParking(), measure=measure)


def process_executor(
    config: PipelineConfig,
    decode_overlap: DecodeOverlap = "off",
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    profile: ProfilePlan | None = None,
) -> ProcessExecutor:
    """`config`'s pipeline in a worker process, which calls `load_configured` and
    `measure_loaded` itself."""
    loading = describe(config.model, config.device, config.pipeline_class)
    import_meanwhile("pipelines.registry")
    load = functools.partial(load_configured, config)
    measure = functools.partial(measure_loaded, config, profile)
    return ProcessExecutor(
        load,
        decode_overlap,
        start_timeout_s=start_timeout_s,
        loading=loading,
        measure=measure,
        step_once=config.lane is not None,
    )


def import_ahead(module: str) -> None:
    """Import `module` now, for a head start only: a spec's classes live in `pipelines/` (on
    torch and diffusers, about 4 s of imports on a CPU), and whoever unpickles one imports
    them then, stalling its thread. A failure is logged, not raised: the code that needs the
    module imports it again and meets the error where it belongs."""
    try:
        importlib.import_module(module)
    except Exception:
        logger.warning("could not import %s ahead of its first use", module, exc_info=True)


def import_meanwhile(module: str) -> None:
    """`import_ahead` on a daemon thread. The worker's `Ready` carries its pipeline's spec:
    unpickled when it arrives, its classes would be imported only after the worker's own
    imports and load. Started beside the worker, the two imports overlap; a thread that needs
    the module meanwhile (the one unpickling `Ready`) waits on Python's import lock for this
    import rather than starting its own."""
    threading.Thread(target=import_ahead, args=(module,), name="diffbatch-import", daemon=True).start()


def lane_group_executor(
    configs: list[PipelineConfig],
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    profile: ProfilePlan | None = None,
) -> LaneGroupExecutor:
    """One lane of several devices: a worker process per member config (each with its seat,
    `PipelineConfig.lane`), which meet as one group as they load. The lead decodes on its
    stepping thread (`--decode-overlap` is off in a lane: its members step once per plan)."""
    return LaneGroupExecutor([process_executor(c, "off", start_timeout_s, profile) for c in configs])
