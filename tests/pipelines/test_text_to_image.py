"""The engine over the real tiny StableDiffusionPipeline: batching must not change images."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import ForwardError, InvalidRequestError
from engine.request import GenerationRequest, RequestOutput, SamplingParams
from pipelines.base import PipelineConfig
from server.composition import thread_executor
from tests.threads import THREADS

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(width=64, height=64, num_inference_steps=4, guidance_scale=7.5)
PROMPTS = [
    "a cat",
    "an astronaut riding a horse on the moon, highly detailed, cinematic lighting",
    "dog",
    "a watercolor painting of a mountain lake at dawn " * 12,  # far past CLIP's 77 tokens
    "portrait of an old man",
    "a bowl of fruit",
    "neon city street at night in the rain",
    "a castle",
]


async def start_engine(pipeline_class: str | None = None, **engine: object) -> AsyncEngine:
    config = PipelineConfig(model="tiny-sd", pipeline_class=pipeline_class, num_threads=THREADS)
    instance = AsyncEngine(thread_executor(config), EngineConfig(**engine))  # type: ignore[arg-type]
    await instance.start()
    return instance


def request(prompt: str, seed: int, **changes: object) -> GenerationRequest:
    return GenerationRequest.create(prompt, replace(PARAMS, seed=seed, **changes))  # type: ignore[arg-type]


async def alone(engine: AsyncEngine, prompt: str, seed: int, **changes: object) -> RequestOutput:
    return await engine.generate(request(prompt, seed, **changes))


def max_level_difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


async def test_eight_concurrent_requests_run_as_one_forward_with_their_own_images() -> None:
    engine = await start_engine(max_num_seqs=8, request_batch_max_wait_ms=5000)
    try:
        batched = await asyncio.gather(*(alone(engine, p, seed=100 + i) for i, p in enumerate(PROMPTS)))
        assert engine.stats.forward_sizes == {8: 1}
        solo = [await alone(engine, p, seed=100 + i) for i, p in enumerate(PROMPTS)]
    finally:
        await engine.stop()
    for together, single in zip(batched, solo, strict=True):
        image = together.images[0]
        assert image.shape == (64, 64, 3) and image.dtype == np.uint8
        assert max_level_difference(image, single.images[0]) <= 1  # within 1/255
    # Different prompts and seeds give different images: the comparison above can fail.
    assert max_level_difference(batched[0].images[0], batched[2].images[0]) > 10


async def test_seed_decides_the_image_and_n_expands_into_seed_plus_i() -> None:
    engine = await start_engine(max_num_seqs=8)
    try:
        one = await alone(engine, "a cat", seed=7)
        again = await alone(engine, "a cat", seed=7)
        other_seed = await alone(engine, "a cat", seed=8)
        three = await alone(engine, "a cat", seed=7, n=3)
    finally:
        await engine.stop()
    assert max_level_difference(one.images[0], again.images[0]) == 0
    assert max_level_difference(one.images[0], other_seed.images[0]) > 10
    assert len(three.images) == 3 and three.seeds == (7, 8, 9)
    assert max_level_difference(three.images[0], one.images[0]) <= 1
    assert max_level_difference(three.images[1], other_seed.images[0]) <= 1


async def test_negative_prompt_changes_only_its_own_request() -> None:
    engine = await start_engine(max_num_seqs=8, request_batch_max_wait_ms=5000)
    try:
        plain, negated = await asyncio.gather(
            alone(engine, "a cat", seed=1), alone(engine, "a cat", seed=2, negative_prompt="blurry, dark")
        )
        assert engine.stats.forward_sizes == {2: 1}
        plain_alone = await alone(engine, "a cat", seed=1)
        negated_without = await alone(engine, "a cat", seed=2)
    finally:
        await engine.stop()
    assert max_level_difference(plain.images[0], plain_alone.images[0]) <= 1
    assert max_level_difference(negated.images[0], negated_without.images[0]) > 1


async def test_a_failing_request_fails_alone_in_a_batch_of_eight() -> None:
    engine = await start_engine(
        "tests.pipelines.custom:MarkedFailurePipeline", max_num_seqs=8, request_batch_max_wait_ms=5000
    )
    prompts = list(PROMPTS)
    prompts[6] = "FAIL me"
    try:
        results = await asyncio.gather(
            *(alone(engine, p, seed=i) for i, p in enumerate(prompts)), return_exceptions=True
        )
    finally:
        await engine.stop()
    assert isinstance(results[6], ForwardError)
    assert "marked to fail" in str(results[6])
    others = [r for i, r in enumerate(results) if i != 6]
    assert all(isinstance(r, RequestOutput) and r.images[0].shape == (64, 64, 3) for r in others)
    assert engine.stats.forward_sizes[8] == 1  # the first try carried all eight


async def test_a_non_batch_pipeline_gets_one_forward_per_request() -> None:
    engine = await start_engine(
        "tests.pipelines.custom:SerialTextToImage", max_num_seqs=8, request_batch_max_wait_ms=200
    )
    try:
        await asyncio.gather(*(alone(engine, p, seed=i) for i, p in enumerate(PROMPTS[:4])))
    finally:
        await engine.stop()
    assert engine.stats.forward_sizes == {1: 4}


async def test_model_defaults_fill_in_and_bad_sizes_name_the_field() -> None:
    engine = await start_engine()
    try:
        output = await engine.generate(
            GenerationRequest.create("a cat", SamplingParams(num_inference_steps=2, seed=3))
        )
        assert output.images[0].shape == (64, 64, 3)
        with pytest.raises(InvalidRequestError) as bad:
            await engine.generate(GenerationRequest.create("a cat", replace(PARAMS, width=60)))
        assert bad.value.param == "width"
        latent = await alone(engine, "a cat", seed=3, output_type="latent")
        assert latent.images[0].shape == (4, 32, 32) and latent.images[0].dtype == np.float32
    finally:
        await engine.stop()
