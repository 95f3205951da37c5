"""HunyuanVideo 1.5's step cost counts the ~2,000 text and image tokens every row attends
over beside its latents, which at small sizes are nearly all of a step's work."""

from __future__ import annotations

import pytest

from engine.request import GenerationRequest, SamplingParams
from tests.pipelines.test_stepping import loaded

pytestmark = pytest.mark.slow


def test_each_row_adds_its_context_tokens() -> None:
    pipeline = loaded("tiny-hunyuan-video15")

    def cost(guidance_scale: float, n: int = 1) -> int:
        params = SamplingParams(num_frames=9, width=32, height=32, guidance_scale=guidance_scale, n=n)
        request = GenerationRequest.create("a cat", params)
        return pipeline.step_cost(request.with_params(pipeline.resolve(request)))

    context = 1000 + 256 + 729  # Qwen, ByT5, image tokens
    latent_tokens = 2 * 2 * 3  # 32x32 at 16x, 9 frames at 4x: 3 latent frames, 1x1x1 patches
    assert cost(guidance_scale=1.0) == latent_tokens + context
    assert cost(guidance_scale=6.0) == 2 * (latent_tokens + context)  # negative rows too
    assert cost(guidance_scale=6.0, n=2) == 4 * (latent_tokens + context)
