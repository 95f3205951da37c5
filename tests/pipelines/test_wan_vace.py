"""Wan VACE (tiny, two experts) step-level: requests with their own control videos, masks and
references, mixed steps, guidance and seeds, joining at different steps, each equal to the
stock `WanVACEPipeline` run alone; request level one request per call; bad inputs refused
naming the field."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine.core.admission import admitted
from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.tasks.control_video import MAX_REFERENCES
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import loaded, mixed_requests, stepped_matches_alone

pytestmark = pytest.mark.slow

FRAMES, SIDE = 9, 32


def pixels(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def control_inputs(i: int, references: int, *, control: bool) -> dict[str, Any]:
    """Request i's inputs: its own control video (every other one with a per-frame mask,
    the others one mask for all frames) and `references` reference images of other sizes."""
    inputs: dict[str, Any] = {
        "input_images": tuple(pixels(100 * i + r, (24 + 8 * r, 40, 3)) for r in range(references))
    }
    if control:
        inputs["control_video"] = pixels(i, (FRAMES, SIDE, SIDE, 3))
        mask = np.zeros((FRAMES, SIDE, SIDE), np.uint8)
        mask[1:, :, SIDE // 2 :] = 255  # keep the first frame and the left half
        inputs["mask"] = mask if i % 2 else mask[1]
    return inputs


# Each request's own conditioning_scale (None: diffusers' default, 1).
SCALES = (1.0, 0.5, None, 1.5, 0.0)


def vace_requests(references: int, *, control: bool) -> Any:
    def make(pipeline: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
        requests = []
        for i, (request, scale) in enumerate(zip(mixed_requests(pipeline, rng), SCALES, strict=True)):
            params = replace(request.params, conditioning_scale=scale)
            own = replace(request, params=params, **control_inputs(i, references, control=control))
            requests.append(own.with_params(pipeline.resolve(own)))
        return requests

    return make


# Two cases of the four input kinds (each a full step matrix, minutes here): a control video
# with a reference covers the control path and references beside it; references alone cover
# the reference-only layout. A control video alone and no inputs are the same code paths.
@pytest.mark.parametrize(("references", "control"), [(1, True), (2, False)], ids=str)
def test_each_request_matches_the_stock_pipeline_alone(references: int, control: bool) -> None:
    stepped_matches_alone(loaded("tiny-wan-vace"), None, vace_requests(references, control=control))


def test_the_request_level_call_is_the_stock_pipelines() -> None:
    """The adapter's own call equals `WanVACEPipeline` called directly with PIL inputs (so the
    stepped comparisons above compare with diffusers' own loop), and a batch of two requests is
    each alone."""
    pipeline = loaded("tiny-wan-vace")
    # The second request: a mask per frame, conditioning_scale 0.5.
    first, second = vace_requests(1, control=True)(pipeline, random.Random(3))[1:3]
    assert first.mask.ndim == 3 and first.params.conditioning_scale == 0.5
    (alone,) = pipeline.forward(RequestBatch(key=(), requests=(first,)))
    params = first.params
    video = pipeline.pipe(
        prompt=first.prompt,
        video=[Image.fromarray(frame) for frame in first.control_video],
        mask=[Image.fromarray(frame) for frame in first.mask],  # one per frame
        reference_images=[Image.fromarray(image) for image in first.input_images],
        height=SIDE,
        width=SIDE,
        num_frames=FRAMES,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        guidance_scale_2=params.guidance_scale_2,
        conditioning_scale=params.conditioning_scale,
        generator=torch.Generator("cpu").manual_seed(params.image_seeds()[0]),
        output_type="np",
    ).frames[0]
    assert difference((video * 255).round().astype(np.uint8), alone.images[0]) <= 1
    together = pipeline.forward(RequestBatch(key=(), requests=(first, second)))
    (second_alone,) = pipeline.forward(RequestBatch(key=(), requests=(second,)))
    for output, reference in zip(together, (alone, second_alone), strict=True):
        for image, expected in zip(output.images, reference.images, strict=True):
            assert difference(image, expected) <= 1


def test_references_are_in_the_step_key_and_cost() -> None:
    pipeline = loaded("tiny-wan-vace")
    none, two = (
        vace_requests(count, control=True)(pipeline, random.Random(0))[0] for count in (0, MAX_REFERENCES - 1)
    )
    assert pipeline.step_key(none) != pipeline.step_key(two)
    # 3 latent frames of video; two references add two.
    assert pipeline.step_cost(two) * 3 == pipeline.step_cost(none) * 5


def refused(request: GenerationRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        admitted(loaded("tiny-wan-vace"), request)
    return raised.value


def test_bad_inputs_are_refused_naming_the_field() -> None:
    params = SamplingParams(num_frames=FRAMES)
    video = pixels(0, (FRAMES, SIDE, SIDE, 3))
    too_many = tuple(pixels(i, (16, 16, 3)) for i in range(MAX_REFERENCES + 1))
    assert refused(GenerationRequest.create("x", params, input_images=too_many)).param == "input_images"
    short = GenerationRequest.create("x", params, control_video=video[:5])
    assert refused(short).param == "video" and "5 frames" in str(refused(short))
    wrong_size = GenerationRequest.create("x", replace(params, width=48, height=32), control_video=video)
    assert refused(wrong_size).param == "video"
    odd = GenerationRequest.create("x", params, control_video=pixels(0, (FRAMES, 24, 32, 3)))
    assert refused(odd).param == "video"
    mask_alone = GenerationRequest.create("x", params, mask=np.zeros((SIDE, SIDE), np.uint8))
    assert refused(mask_alone).param == "mask"
    bad_mask = GenerationRequest.create("x", params, control_video=video, mask=np.zeros((16, 16), np.uint8))
    assert refused(bad_mask).param == "mask"
    # The size defaults to the control video's.
    ok = admitted(loaded("tiny-wan-vace"), GenerationRequest.create("x", params, control_video=video))
    assert (ok.params.width, ok.params.height) == (SIDE, SIDE)


def test_other_models_refuse_a_control_video() -> None:
    request = GenerationRequest.create(
        "x", SamplingParams(num_frames=FRAMES), control_video=pixels(0, (FRAMES, SIDE, SIDE, 3))
    )
    with pytest.raises(InvalidRequestError) as raised:
        admitted(loaded("tiny-wan22"), request)
    assert raised.value.param == "video"
    scaled = GenerationRequest.create("x", SamplingParams(num_frames=FRAMES, conditioning_scale=0.5))
    with pytest.raises(InvalidRequestError) as raised:
        admitted(loaded("tiny-wan22"), scaled)
    assert raised.value.param == "conditioning_scale"
