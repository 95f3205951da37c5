"""Edits that start from the input image, over the tiny models: image-to-image puts
`strength` in the batch key (two strengths run as two batches, each image equal to its solo
run); inpainting repaints only the masked area and batches (equal to solo), for Stable
Diffusion and Qwen-Image."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.base import Pipeline, PipelineConfig
from pipelines.registry import load_pipeline
from server.composition import thread_executor
from tests.media import picture
from tests.pipelines.edit_families import IMAGE_TO_IMAGE, INPAINTING
from tests.pipelines.engines import difference

pytestmark = pytest.mark.slow


def request(seed: int, strength: float | None = None, mask: np.ndarray | None = None) -> GenerationRequest:
    params = SamplingParams(seed=seed, num_inference_steps=4, strength=strength)
    image = picture(64, 48, seed=9)
    return GenerationRequest.create(f"a painting {seed}", params, input_images=(image,), mask=mask)


def solo(pipeline: Pipeline, sent: GenerationRequest) -> np.ndarray:
    """The request's first image, run alone."""
    alone = sent.with_params(pipeline.resolve(sent))
    (output,) = pipeline.forward(RequestBatch(pipeline.batch_key(alone), (alone,)))
    image: np.ndarray = output.images[0]
    return image


async def run_together(
    config: PipelineConfig, requests: list[GenerationRequest]
) -> tuple[AsyncEngine, list[np.ndarray]]:
    engine = AsyncEngine(
        thread_executor(config), EngineConfig(max_num_seqs=8, request_batch_max_wait_ms=5000)
    )
    await engine.start()
    try:
        outputs = await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.stop()
    return engine, [output.images[0] for output in outputs]


@pytest.mark.parametrize("family", list(IMAGE_TO_IMAGE))
async def test_two_strengths_run_as_two_batches_each_equal_to_its_solo_run(family: str) -> None:
    config = IMAGE_TO_IMAGE[family]
    requests = [request(1, 0.5), request(2, 0.9), request(3, 0.5), request(4)]  # no strength: 0.8
    engine, images = await run_together(config, requests)
    assert sorted(engine.stats.forward_sizes.elements()) == [1, 1, 2]  # 0.5 twice; 0.9; 0.8
    pipeline = load_pipeline(config)
    for sent, image in zip(requests, images, strict=True):
        assert image.shape == (48, 64, 3)  # the input's size
        assert difference(image, solo(pipeline, sent)) <= 1
    # Strength changes the image: the same request at another strength is another image.
    assert difference(solo(pipeline, request(1, 0.5)), solo(pipeline, request(1, 0.9))) > 10


@pytest.mark.parametrize("family", list(INPAINTING))
async def test_inpainting_repaints_only_the_mask_and_batches(family: str) -> None:
    config = INPAINTING[family]
    mask = np.zeros((48, 64), np.uint8)
    mask[8:40, 16:48] = 255  # diffusers' convention, as the server hands it over
    requests = [request(seed, mask=mask) for seed in (1, 2, 3)]
    engine, images = await run_together(config, requests)
    assert sorted(engine.stats.forward_sizes.elements()) == [3]
    pipeline = load_pipeline(config)
    source, keep = picture(64, 48, seed=9), mask == 0
    for sent, image in zip(requests, images, strict=True):
        assert np.array_equal(image[keep], source[keep])
        assert (image[~keep] != source[~keep]).mean() > 0.5
        assert difference(image, solo(pipeline, sent)) <= 1


def test_strength_on_a_text_to_image_model_is_refused() -> None:
    text_to_image = load_pipeline(PipelineConfig(model="tiny-sd"))
    with pytest.raises(ValueError, match="strength"):
        text_to_image.validate(text_to_image.resolve(request(1, 0.5)))
