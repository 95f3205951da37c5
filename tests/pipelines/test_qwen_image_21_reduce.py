"""Qwen-Image 2.1 references larger than the call uses are reduced before they queue, as the
call first resizes them: the text encoder and the VAE get the same pixels from the reduced
request as from the upload, on the stock call and stepped; a reference whose size the call's
rounding would move, and one smaller than its size in the call, wait as sent."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine.core.inputs import prepared_inputs
from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.family_options import FamilyOptions
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.threads import THREADS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline() -> DiffusersAdapter:
    # References at 64x64 pixels' area (the call's default is 1024x1024).
    options = FamilyOptions(reference_resolution=64)
    loaded = load_pipeline(PipelineConfig(model="tiny-qwen-image-21", num_threads=THREADS, options=options))
    assert isinstance(loaded, DiffusersAdapter)
    return loaded


Seen = tuple[list[np.ndarray], list[torch.Tensor]]


def seen(pipeline: DiffusersAdapter, run: Any) -> Seen:
    """The pictures `run()` hands the text encoder and the pixels it hands the VAE."""
    pipe = pipeline.pipe
    pictures: list[np.ndarray] = []
    pixels: list[torch.Tensor] = []
    encode_prompt, encode_vae = pipe.encode_prompt, pipe._encode_vae_image

    def recording_prompt(*args: Any, image: Any = None, **kwargs: Any) -> Any:
        pictures.extend(np.asarray(picture) for picture in image or ())
        return encode_prompt(*args, image=image, **kwargs)

    def recording_vae(image: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        pixels.append(image.clone())
        return encode_vae(image, *args, **kwargs)

    pipe.encode_prompt, pipe._encode_vae_image = recording_prompt, recording_vae
    try:
        run()
    finally:
        del pipe.encode_prompt, pipe._encode_vae_image
    return pictures, pixels


def assert_same(ours: Seen, theirs: Seen) -> None:
    assert len(ours[0]) == len(theirs[0]) > 0 and len(ours[1]) == len(theirs[1]) > 0
    for encoded, stock_encoded in zip(ours[0], theirs[0], strict=True):
        assert np.array_equal(encoded, stock_encoded)
    for pixels, stock_pixels in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(pixels, stock_pixels)


def test_large_references_are_reduced_before_they_queue_to_what_the_call_makes_of_them(
    pipeline: DiffusersAdapter,
) -> None:
    # 512x256: 96x32 in the call, a size its own aspect ratio gives again; 100x166: 64x96 in
    # the call, whose ratio would give 64x64 (so it waits as sent); 40x40: smaller than 64x64.
    large, drifting, small = picture(512, 256, seed=1), picture(100, 166, seed=2), picture(40, 40, seed=3)
    params = SamplingParams(num_inference_steps=1, seed=1, width=64, height=64)
    sent = GenerationRequest.create("a cat", params, input_images=(large, drifting, small))
    reduced = prepared_inputs(pipeline.spec(), sent)

    assert reduced.input_images[0].shape == (32, 96, 3)
    assert reduced.input_images[1] is drifting and reduced.input_images[2] is small
    assert reduced.input_bytes < sent.input_bytes / 2

    def stock(request: GenerationRequest) -> Seen:
        images = [Image.fromarray(image) for image in request.input_images]
        call = {"prompt": "a cat", "image": images, "width": 64, "height": 64, "num_inference_steps": 1}
        return seen(pipeline, lambda: pipeline.pipe(**call, output_resolution=64))

    def stepped(request: GenerationRequest) -> Seen:
        return seen(pipeline, lambda: pipeline.prepare([request.with_params(pipeline.resolve(request))]))

    assert_same(stock(reduced), stock(sent))
    assert_same(stepped(reduced), stepped(sent))
    assert_same(stepped(sent), stock(sent))
