"""FLUX.2 references over 1 MP are reduced before they queue, as the pipeline first reduces
them: what reaches the model from the reduced request is what the stock call makes of the
upload, and the request holds far fewer bytes while it waits."""

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
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.threads import THREADS

pytestmark = pytest.mark.slow


class SeenError(Exception):
    """Raised once the references' pixels are seen: the rest of the call is not needed."""


def vae_pixels(pipeline: DiffusersAdapter, run: Any) -> list[torch.Tensor]:
    """The reference pixels `run()` hands `prepare_image_latents` (the VAE's input)."""
    pipe = pipeline.pipe
    seen: list[torch.Tensor] = []
    original = pipe.prepare_image_latents

    def recording(images: list[torch.Tensor], **kwargs: Any) -> Any:
        seen.extend(images)
        raise SeenError

    pipe.prepare_image_latents = recording
    try:
        with pytest.raises(SeenError):
            run()
    finally:
        pipe.prepare_image_latents = original
    return seen


def test_a_4k_reference_is_reduced_before_it_queues_to_what_the_call_makes_of_it() -> None:
    pipeline = load_pipeline(PipelineConfig(model="tiny-flux2-klein", num_threads=THREADS))
    assert isinstance(pipeline, DiffusersAdapter)
    upload, small = picture(3840, 2160, seed=1), picture(64, 80, seed=2)
    params = SamplingParams(num_inference_steps=2, seed=1, width=64, height=64)
    sent = GenerationRequest.create("a cat", params, input_images=(upload, small))
    reduced = prepared_inputs(pipeline.spec(), sent)

    assert reduced.input_images[0].shape == (768, 1365, 3)  # 1 MP, aspect kept, as the call
    assert reduced.input_images[1] is small  # under 1 MP: the call takes it as sent
    assert reduced.input_bytes < sent.input_bytes / 7
    resolved = reduced.with_params(pipeline.resolve(reduced))
    assert pipeline.step_key(resolved) == pipeline.step_key(sent.with_params(pipeline.resolve(sent)))

    stock = vae_pixels(
        pipeline,
        lambda: pipeline.pipe(
            prompt="a cat", image=[Image.fromarray(image) for image in sent.input_images], height=64, width=64
        ),
    )
    stepped = vae_pixels(pipeline, lambda: pipeline.prepare([resolved]))
    assert [pixels.shape for pixels in stock] == [(1, 3, 768, 1364), (1, 3, 80, 64)]
    for ours, theirs in zip(stepped, stock, strict=True):
        # [-1, 1] pixels: 2/255 is one level of 255.
        assert (ours - theirs).abs().max() <= 2 / 255
    assert np.array_equal(stepped[0].numpy(), stock[0].numpy())
