"""A model's size read from its files before it loads (`pipelines.memory.estimate`), and
parking a model's weights in host memory and back (`pipelines.memory.parking`, through
`ThreadExecutor.move_weights`): a plain tiny model round-trips and serves the same image;
one with offload hooks or float8 storage is refused, with the reason. On this CPU the
device is the host: the round trip is the bookkeeping and the calls, not a transfer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.memory.estimate import estimated_weight_bytes
from pipelines.memory.footprint import weight_bytes
from pipelines.memory.options import MemoryConfig, Quantization
from pipelines.memory.parking import park_blocker, weights_device
from pipelines.registry import load_pipeline
from server.composition import thread_executor
from tests.threads import THREADS

pytestmark = pytest.mark.slow


def test_a_plain_model_round_trips_and_serves_the_same_image() -> None:
    async def scenario() -> None:
        config = PipelineConfig(model="tiny-sd", num_threads=THREADS, prompt_cache_mb=16)
        executor = thread_executor(config)
        spec = (await executor.start()).spec
        request = GenerationRequest.create("a red cat", SamplingParams(num_inference_steps=2, seed=3))
        batch = RequestBatch(key=(), requests=(request.with_params(spec.resolve(request)),))
        before = (await executor.execute_batch(batch)).outputs[request.request_id].images[0]
        assert await executor.park_blocker() is None
        prompt_cache = getattr(executor._pipeline, "prompt_cache", None)
        assert prompt_cache is not None and prompt_cache.nbytes > 0
        await executor.move_weights(to_host=True)
        assert weights_device(executor._pipeline) == "cpu"
        assert prompt_cache.nbytes == 0  # its embeddings left the device with the weights
        await executor.move_weights(to_host=False)
        after = (await executor.execute_batch(batch)).outputs[request.request_id].images[0]
        assert np.array_equal(np.asarray(before), np.asarray(after))
        await executor.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("scheme", ["group", "layerwise"])
def test_offload_hooks_and_float8_storage_are_not_parked(scheme: str, tmp_path: Path) -> None:
    if scheme == "group":
        memory = MemoryConfig(offload="group", offload_to_disk=str(tmp_path / "offload"))
    else:
        memory = MemoryConfig(quantization=Quantization("layerwise", "float8_e4m3fn"))
    pipeline = load_pipeline(PipelineConfig(model="tiny-sd", num_threads=THREADS, memory=memory))
    assert park_blocker(pipeline) is not None
    pipeline.close()


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-flux"])
def test_the_size_read_from_the_files_is_the_size_loaded(model: str) -> None:
    pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS))
    measured = weight_bytes(pipeline)
    estimated = estimated_weight_bytes(model, "auto", "cpu")
    assert estimated is not None and abs(estimated - measured) <= 0.01 * measured
    half = estimated_weight_bytes(model, "bfloat16", "cpu")
    assert half is not None and abs(2 * half - estimated) <= 0.01 * estimated
    assert estimated_weight_bytes("no/such-model-here", "auto", "cpu") is None
