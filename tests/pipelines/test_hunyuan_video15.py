"""HunyuanVideo 1.5 specifics: image-to-video is sized by its input image's bucket (a request
asking another size is refused, naming `size`), and the guider, not the call, holds the
guidance scale that request level sets per batch; a step's forward leaves out the text padding
no row reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.pipelines.test_stepping import loaded
from tests.threads import THREADS

pytestmark = pytest.mark.slow


def test_image_to_video_takes_the_image_bucket_and_refuses_another_size() -> None:
    pipeline = load_pipeline(PipelineConfig(model="tiny-hunyuan-video15-i2v", num_threads=THREADS))
    wide = np.zeros((32, 64, 3), dtype=np.uint8)
    bucket = pipeline.family.size_from_image(wide)  # type: ignore[attr-defined]
    assert bucket is not None and bucket[0] > bucket[1]  # a wide image, a wide video
    request = GenerationRequest.create("x", SamplingParams(num_frames=9), input_images=(wide,))
    resolved = pipeline.resolve(request)
    assert (resolved.width, resolved.height) == bucket
    pipeline.resolve(request.with_params(SamplingParams(num_frames=9, width=bucket[0], height=bucket[1])))
    with pytest.raises(InvalidRequestError) as refused:
        pipeline.resolve(request.with_params(SamplingParams(num_frames=9, width=32, height=32)))
    assert refused.value.param == "size"


def test_request_level_sets_the_guiders_scale() -> None:
    pipeline = load_pipeline(PipelineConfig(model="tiny-hunyuan-video15", num_threads=THREADS))
    assert pipeline.family.call_kwargs(SamplingParams(guidance_scale=2.5)) == {}  # type: ignore[attr-defined]
    assert pipeline.pipe.guider.guidance_scale == 2.5  # type: ignore[attr-defined]


def test_a_step_attends_over_its_longest_prompt_not_the_padding() -> None:
    """Rows of a short prompt, the empty negative and one with quoted text: the forward gets
    the longest row's Qwen tokens and the quoted text's ByT5 tokens, not the 1000 + 256 the
    encoders pad to, nor text-to-video's 729 zero image tokens; and predicts what the stock
    call's padded forward does."""
    pipeline = loaded("tiny-hunyuan-video15")
    pipe = pipeline.pipe
    texts = ["a cat", "", 'a shop sign that reads "OPEN ALL NIGHT"']
    encoded = pipe.encode_prompt(prompt=texts, device=torch.device("cpu"), batch_size=len(texts))
    names = (
        "encoder_hidden_states",
        "encoder_attention_mask",
        "encoder_hidden_states_2",
        "encoder_attention_mask_2",
    )
    cond = dict(zip(names, encoded, strict=True))
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn((3, pipe.num_channels_latents, 3, 2, 2), generator=generator)
    timesteps = torch.tensor([900.0, 900.0, 400.0])

    seen: dict[str, Any] = {}
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.update(kwargs), with_kwargs=True
    )
    try:
        with torch.no_grad():
            got = pipeline.family.denoise([], latents, timesteps, cond)
    finally:
        hook.remove()
    assert (
        seen["encoder_hidden_states"].shape[1] == int(cond["encoder_attention_mask"].sum(dim=1).max()) < 1000
    )
    assert seen["encoder_hidden_states_2"].shape[1] == int(cond["encoder_attention_mask_2"][2].sum()) > 0
    assert seen["image_embeds"].shape[1] == 0

    # The stock call's forward: padded text, zero condition channels and image tokens.
    condition = torch.zeros((3, pipe.num_channels_latents + 1, 3, 2, 2))
    image_embeds = torch.zeros((3, pipe.vision_num_semantic_tokens, pipe.vision_states_dim))
    with torch.no_grad():
        (stock,) = pipe.transformer(
            hidden_states=torch.cat([latents, condition], dim=1),
            image_embeds=image_embeds,
            timestep=timesteps,
            return_dict=False,
            **cond,
        )
    torch.testing.assert_close(got, stock, rtol=0, atol=1e-5)
