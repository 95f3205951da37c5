"""Subnormal floats in the threads that run a pipeline (`--flush-denormal`): flushed to zero
by default in the executor's thread and in a worker process, and in the threads those
start; kept with the setting off. Through the real executors the server composes."""

from __future__ import annotations

import threading

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.abstract import Executor
from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from server.composition import process_executor, thread_executor
from server.settings import ServeSettings
from tests.pipelines.float_probe import subnormals_kept

PROBE = "tests.pipelines.float_probe:SubnormalProbe"


async def _probe(kind: str, flush: bool) -> tuple[int, int]:
    """(red, green) of the probe's image: 255 where a subnormal survived."""
    config = PipelineConfig(pipeline_class=PROBE, flush_denormal=flush)
    executor: Executor = thread_executor(config) if kind == "thread" else process_executor(config)
    engine = AsyncEngine(executor, EngineConfig(max_num_seqs=1, batching="request"))
    await engine.start()
    try:
        output = await engine.generate(
            GenerationRequest.create("x", SamplingParams(width=8, height=8, seed=1))
        )
    finally:
        await engine.stop()
    red, green, _ = output.images[0][0, 0]
    return int(red), int(green)


@pytest.mark.parametrize("kind", ["thread", "process"])
async def test_subnormals_are_flushed_where_the_pipeline_runs(kind: str) -> None:
    assert subnormals_kept()  # here, in the test's own thread, they are not flushed...
    assert await _probe(kind, flush=True) == (0, 0)  # ...there, and in a thread it starts, they are


async def test_with_the_setting_off_subnormals_are_kept() -> None:
    assert await _probe("thread", flush=False) == (255, 255)
    # The setting went nowhere but the pipeline's thread.
    assert threading.current_thread() is threading.main_thread() and subnormals_kept()


def test_the_flag_reaches_the_pipeline_config() -> None:
    assert ServeSettings.model_validate({"model": "tiny-sd"}).pipeline_config().flush_denormal
    off = ServeSettings.model_validate({"model": "tiny-sd", "flush_denormal": False})  # YAML's bare `off`
    assert not off.pipeline_config().flush_denormal
