"""HunyuanVideo 1.5's step cost counts the text tokens every row may attend over beside its
latents (its group's longest prompt: at most the encoders' 1000 + 256, counted whole) and in
image-to-video the image's tokens; text-to-video passes no image tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, SamplingParams
from tests.pipelines.test_stepping import loaded

pytestmark = pytest.mark.slow

LATENT_TOKENS = 2 * 2 * 3  # 32x32 at 16x, 9 frames at 4x: 3 latent frames, 1x1x1 patches
TEXT_TOKENS = 1000 + 256  # Qwen, ByT5


def cost(model: str, prompt: str, guidance_scale: float, n: int = 1) -> int:
    pipeline = loaded(model)
    params = SamplingParams(num_frames=9, width=32, height=32, guidance_scale=guidance_scale, n=n)
    images = (np.zeros((32, 32, 3), dtype=np.uint8),) if pipeline.input_image_count[0] else ()
    request = GenerationRequest.create(prompt, params, input_images=images)
    return pipeline.step_cost(request.with_params(pipeline.resolve(request)))


def test_each_row_adds_the_text_it_may_attend_over() -> None:
    model = "tiny-hunyuan-video15"
    assert cost(model, "a cat", guidance_scale=1.0) == LATENT_TOKENS + TEXT_TOKENS
    assert cost(model, "a cat", guidance_scale=6.0) == 2 * (LATENT_TOKENS + TEXT_TOKENS)  # negative rows too
    assert cost(model, "a cat", guidance_scale=6.0, n=2) == 4 * (LATENT_TOKENS + TEXT_TOKENS)
    # Whatever the prompt says: its group may hold a longer one.
    assert (
        cost(model, 'a shop sign that reads "OPEN" ' * 20, guidance_scale=1.0) == LATENT_TOKENS + TEXT_TOKENS
    )


def test_image_to_video_rows_add_the_images_tokens() -> None:
    model = "tiny-hunyuan-video15-i2v"
    pipe = loaded(model).pipe
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    image_tokens = pipe.encode_image(
        image=image, batch_size=1, device=torch.device("cpu"), dtype=torch.float32
    )
    assert cost(model, "a cat", guidance_scale=1.0) == LATENT_TOKENS + TEXT_TOKENS + image_tokens.shape[1]
