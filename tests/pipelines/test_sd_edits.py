"""Stable Diffusion image-to-image over the tiny model: `strength` is in the batch key, so
requests of two strengths run as two batches, and each image equals its solo run."""

from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.engine import AsyncEngine
from engine.executor import ThreadExecutor
from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.pipelines.engines import difference

pytestmark = pytest.mark.slow

CONFIG = PipelineConfig(
    model="tiny-sd", pipeline_class="pipelines.sd_edits:StableDiffusionImageToImage", num_threads=2
)


def request(seed: int, strength: float | None) -> GenerationRequest:
    params = SamplingParams(seed=seed, num_inference_steps=4, strength=strength)
    return GenerationRequest.create(f"a painting {seed}", params, input_images=(picture(48, 40, seed=9),))


async def test_two_strengths_run_as_two_batches_each_equal_to_its_solo_run() -> None:
    engine = AsyncEngine(
        ThreadExecutor.for_config(CONFIG), EngineConfig(max_num_seqs=8, request_batch_max_wait_ms=5000)
    )
    await engine.start()
    try:
        requests = [request(1, 0.5), request(2, 0.9), request(3, 0.5), request(4, None)]  # None: 0.8
        outputs = await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.stop()
    assert sorted(engine.stats.forward_sizes.elements()) == [1, 1, 2]  # 0.5 twice; 0.9; 0.8
    pipeline = load_pipeline(CONFIG)
    for sent, output in zip(requests, outputs, strict=True):
        alone = sent.with_params(pipeline.resolve(sent))
        (solo,) = pipeline.forward(RequestBatch(pipeline.batch_key(alone), (alone,)))
        assert output.images[0].shape == (40, 48, 3)  # the input's size
        assert difference(output.images[0], solo.images[0]) <= 1
    # Strength changes the image: the same request at another strength is another image.
    at = [request(1, strength) for strength in (0.5, 0.9)]
    images = [
        pipeline.forward(RequestBatch(pipeline.batch_key(r), (r.with_params(pipeline.resolve(r)),)))[0]
        for r in at
    ]
    assert difference(images[0].images[0], images[1].images[0]) > 10


def test_strength_outside_0_1_or_on_a_text_to_image_model_is_refused() -> None:
    text_to_image = load_pipeline(PipelineConfig(model="tiny-sd"))
    with pytest.raises(ValueError, match="strength"):
        text_to_image.validate(text_to_image.resolve(request(1, 0.5)))
