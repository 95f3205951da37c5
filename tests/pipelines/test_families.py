"""Every family on its tiny model: batching must not change any image or video."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from engine.request import GenerationRequest, RequestOutput, SamplingParams
from tests.pipelines.engines import difference, start_batching_engine

# Qwen-Image-Edit's input image at 128x128, not ~1024x1024, for the stock call and ours alike.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("small_edit_references")]

# Flux runs true CFG (where negative prompts matter) only with true_cfg_scale > 1.
FAMILIES = {
    "tiny-sd": SamplingParams(),
    "tiny-sdxl": SamplingParams(),
    "tiny-sd3": SamplingParams(),
    "tiny-flux": SamplingParams(true_cfg_scale=2.0),
    "tiny-qwen-image": SamplingParams(),
    # Video families: each "image" is a (frames, height, width, 3) video.
    "tiny-wan": SamplingParams(num_frames=9, width=32, height=32),
    "tiny-ltx": SamplingParams(num_frames=9, width=32, height=32, fps=8),
    "tiny-ltx2": SamplingParams(num_frames=9, width=32, height=32, fps=24),
    # Families with an input image: every request brings one (see INPUTS).
    "tiny-wan-i2v": SamplingParams(num_frames=9, width=32, height=32),
    "tiny-qwen-image-edit": SamplingParams(),
    # The shipped trained models: long prompts and words they never saw are truncated and
    # read as the unknown token, never an error.
    "shapes": SamplingParams(),
    "shapes-dit": SamplingParams(true_cfg_scale=2.0),
    # Issue 24: Wan 2.2's two experts (guidance_scale_2 in the key), HunyuanVideo 1.5 (its
    # image-to-video size comes from the input image).
    "tiny-wan22": SamplingParams(num_frames=9, width=32, height=32, guidance_scale_2=3.0),
    "tiny-hunyuan-video15": SamplingParams(num_frames=9, width=32, height=32),
    "tiny-hunyuan-video15-i2v": SamplingParams(num_frames=9),
    "tiny-z-image": SamplingParams(),  # CFG (scale 5) with each request's negative
    "tiny-chroma": SamplingParams(),  # likewise
    "tiny-ovis-image": SamplingParams(),  # likewise
}
# The input image of request i. Wan I2V batches only requests with the same image; an
# edit batches images of one aspect ratio (here 3:2, of different sizes).
_RNG_IMAGES = [
    np.random.default_rng(i).integers(0, 256, (32 * (1 + i % 2), 48 * (1 + i % 2), 3), dtype=np.uint8)
    for i in range(4)
]
INPUTS: dict[str, Callable[[int], tuple[np.ndarray, ...]]] = {
    "tiny-wan-i2v": lambda i: (_RNG_IMAGES[0],),
    "tiny-qwen-image-edit": lambda i: (_RNG_IMAGES[i],),
    "tiny-hunyuan-video15-i2v": lambda i: (_RNG_IMAGES[0],),
}
PROMPTS = [
    "a cat",
    "an astronaut riding a horse on the moon, highly detailed, cinematic lighting, sharp focus",
    "a watercolor painting of a mountain lake at dawn " * 12,
    "dog",
]
NEGATIVES = ["blurry", "low quality, dark", "text, watermark", "ugly"]


@pytest.mark.parametrize("model", list(FAMILIES))
async def test_a_batch_of_four_matches_each_request_alone(model: str) -> None:
    base = replace(FAMILIES[model], num_inference_steps=3)
    images: Callable[[int], tuple[np.ndarray, ...]] = INPUTS.get(model, lambda i: ())

    def request(i: int, **changes: object) -> GenerationRequest:
        fields: dict[str, object] = {"seed": 10 * i, "negative_prompt": NEGATIVES[i], **changes}
        params = replace(base, **fields)  # type: ignore[arg-type]
        return GenerationRequest.create(PROMPTS[i], params, input_images=images(i))

    engine = await start_batching_engine(model)
    try:
        # Request 1 asks for n=2: five images in one forward of four requests.
        batched = await asyncio.gather(*(engine.generate(request(i, n=2 if i == 1 else 1)) for i in range(4)))
        assert engine.stats.forward_sizes == {4: 1}
        alone: list[RequestOutput] = [await engine.generate(request(i)) for i in range(4)]
        second_of_pair = await engine.generate(
            GenerationRequest.create(
                PROMPTS[1], replace(base, seed=11, negative_prompt=NEGATIVES[1]), input_images=images(1)
            )
        )
        other_negative = await engine.generate(request(0, negative_prompt="a completely different negative"))
    finally:
        await engine.stop()
    for together, single in zip(batched, alone, strict=True):
        assert difference(together.images[0], single.images[0]) <= 1  # within 1/255
    assert batched[1].seeds == (10, 11) and len(batched[1].images) == 2
    assert difference(batched[1].images[1], second_of_pair.images[0]) <= 1
    # The comparisons above can fail: seeds, prompts and negative prompts change images.
    assert difference(batched[0].images[0], batched[3].images[0]) > 10
    assert difference(other_negative.images[0], alone[0].images[0]) > 1
