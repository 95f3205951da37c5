"""Families with input images (edits, image-to-video) or audio (LTX-2), on their tiny models."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

from bench.small_references import REFERENCE_AREA
from engine.core.engine import AsyncEngine
from engine.request import GenerationRequest, InvalidRequestError, RequestOutput, SamplingParams
from tests.media import picture
from tests.pipelines.engines import difference, start_batching_engine
from tests.threads import THREADS

# Qwen-Image-Edit's input image at 128x128, not ~1024x1024, for the stock call and ours alike.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("small_edit_references")]


async def batched_then_alone(
    engine: AsyncEngine, requests: list[GenerationRequest]
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    together = await asyncio.gather(*(engine.generate(r) for r in requests))
    alone = []
    for r in requests:
        alone.append(
            await engine.generate(GenerationRequest.create(r.prompt, r.params, input_images=r.input_images))
        )
    return list(together), alone


async def test_wan_i2v_batches_requests_that_share_an_input_image() -> None:
    params = SamplingParams(num_frames=9, num_inference_steps=2, seed=3)
    shared, other = picture(40, 40, 1), picture(40, 40, 2)
    engine = await start_batching_engine("tiny-wan-i2v")
    try:
        requests = [
            GenerationRequest.create(p, params, input_images=(shared,))
            for p in ("a boat", "a red car on a road")
        ]
        together, alone = await batched_then_alone(engine, requests)
        assert engine.stats.forward_sizes[2] == 1
        different = await engine.generate(GenerationRequest.create("a boat", params, input_images=(other,)))
        with pytest.raises(InvalidRequestError):
            await engine.generate(GenerationRequest.create("no image", params))
    finally:
        await engine.stop()
    for batched, single in zip(together, alone, strict=True):
        assert batched.images[0].shape == (9, 32, 32, 3)
        assert difference(batched.images[0], single.images[0]) <= 1
    assert difference(different.images[0], together[0].images[0]) > 1  # the image matters


async def test_ltx2_makes_audio_per_video_and_batches() -> None:
    params = SamplingParams(num_frames=9, num_inference_steps=2, fps=24, seed=4)
    engine = await start_batching_engine("tiny-ltx2")
    try:
        requests = [
            GenerationRequest.create(p, params) for p in ("rain on a roof", "a dog barking in a park " * 5)
        ]
        together, alone = await batched_then_alone(engine, requests)
        assert engine.stats.forward_sizes[2] == 1
    finally:
        await engine.stop()
    for batched, single in zip(together, alone, strict=True):
        (audio,) = batched.extras["audio"]
        assert batched.extras["sample_rate"] == [16000]
        assert audio.dtype == np.float32 and audio.shape[0] == 2 and audio.shape[1] > 16000 * 9 / 24 * 0.8
        assert difference(batched.images[0], single.images[0]) <= 1
        assert np.abs(audio - single.extras["audio"][0]).max() < 1e-3


async def test_qwen_image_edit_batches_inputs_of_one_aspect_ratio() -> None:
    params = SamplingParams(num_inference_steps=2, seed=5)
    engine = await start_batching_engine("tiny-qwen-image-edit")
    try:
        requests = [
            GenerationRequest.create("make it blue", params, input_images=(picture(48, 32, 1),)),
            GenerationRequest.create("add a hat", params, input_images=(picture(96, 64, 2),)),  # same 3:2
        ]
        together, alone = await batched_then_alone(engine, requests)
        assert engine.stats.forward_sizes[2] == 1
    finally:
        await engine.stop()
    for batched, single in zip(together, alone, strict=True):
        assert batched.images[0].shape == (64, 64, 3)
        assert difference(batched.images[0], single.images[0]) <= 1


async def test_qwen_image_edit_plus_takes_several_images_one_request_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # References at 64x64, not ~1024x1024: what is checked here is how requests are batched.
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", REFERENCE_AREA)
    params = SamplingParams(num_inference_steps=2, seed=6, n=2)
    engine = await start_batching_engine("tiny-qwen-image-edit-plus")
    try:
        images = (picture(32, 32, 1), picture(48, 32, 2))
        outputs = await asyncio.gather(
            *(engine.generate(GenerationRequest.create(p, params, input_images=images)) for p in ("a", "b"))
        )
    finally:
        await engine.stop()
    assert engine.stats.forward_sizes == {1: 2}
    assert all(len(o.images) == 2 and o.images[0].shape == (64, 64, 3) for o in outputs)


def test_a_qwen_image_edit_request_is_the_stock_call_with_its_one_image() -> None:
    """diffusers shows Qwen2.5-VL a list of images as sent but one image resized to the
    condition size; a request is served as the documented one-image call."""
    from PIL import Image

    from engine.request import RequestBatch
    from pipelines.base import PipelineConfig
    from pipelines.registry import load_pipeline

    pipeline = load_pipeline(PipelineConfig(model="tiny-qwen-image-edit", num_threads=THREADS))
    image = picture(48, 32, 3)
    request = GenerationRequest.create(
        "add a hat", SamplingParams(num_inference_steps=2, seed=4), input_images=(image,)
    )
    request = request.with_params(pipeline.resolve(request))
    (served,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
    params = request.params
    stock = pipeline.pipe(  # type: ignore[attr-defined]
        prompt="add a hat",
        image=Image.fromarray(image),
        width=params.width,
        height=params.height,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        generator=[torch.Generator("cpu").manual_seed(4)],
        output_type="np",
    ).images[0]
    assert difference(served.images[0], (np.clip(stock, 0, 1) * 255).round().astype(np.uint8)) <= 1
