"""FLUX Redux (`pipelines.redux_flux`) batched step by step: in one step group of Redux requests
— two images at scale 1, two reference images at scales 0.5 and 1, and one with no prompt (as a
variation is drawn) that joins at step 1 — each request's image equals diffusers' two-stage
recipe run alone for it (`FluxPriorReduxPipeline` with the model's text encoders, then
`FluxPipeline(prompt_embeds=..., pooled_prompt_embeds=...)`) within 1/255; requests with and
without Redux get different step keys (their text lengths differ), other images and scales
the same; true CFG is refused; the tiny prior's reference visibly moves the image (issue 47)."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, FluxPriorReduxPipeline
from PIL import Image

from engine.request import GenerationRequest, InvalidRequestError, IPAdapterRef, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.tiny.cache import tiny_model_dir
from pipelines.tiny.redux import tiny_redux_dir
from tests.pipelines.engines import difference
from tests.pipelines.test_ip_adapter import picture
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flux() -> DiffusersAdapter:
    config = PipelineConfig(
        model="tiny-flux", num_threads=THREADS, ip_adapters=(("look", "tiny-flux-redux"),)
    )
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
    return pipeline


def request(
    flux: DiffusersAdapter, prompt: str, refs: tuple[IPAdapterRef, ...], **fields: Any
) -> GenerationRequest:
    params = SamplingParams(width=64, height=64, guidance_scale=3.5, **fields)
    created = GenerationRequest.create(prompt, params, ip_adapters=refs)
    created = created.with_params(flux.resolve(created))
    return flux.reduce_inputs(created)


@cache
def stock() -> tuple[FluxPipeline, FluxPriorReduxPipeline]:
    """diffusers' two pipelines from the weights on disk, the prior with the model's text encoders."""
    pipe = FluxPipeline.from_pretrained(tiny_model_dir("tiny-flux"))
    pipe.set_progress_bar_config(disable=True)
    prior = FluxPriorReduxPipeline.from_pretrained(
        tiny_redux_dir("tiny-flux-redux"),
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        text_encoder_2=pipe.text_encoder_2,
        tokenizer_2=pipe.tokenizer_2,
    )
    return pipe, prior


def two_stage(request: GenerationRequest, references: list[np.ndarray]) -> list[np.ndarray]:
    """diffusers' Redux recipe for `request` alone, one call per image."""
    pipe, prior = stock()
    scales = [ref.scale for ref in request.ip_adapters]
    params = request.params
    out = []
    with torch.inference_mode():
        embeds = prior(
            image=[Image.fromarray(image) for image in references],
            prompt=request.prompt,
            prompt_embeds_scale=scales,
            pooled_prompt_embeds_scale=scales,
        )
        for seed in params.image_seeds():
            result = pipe(
                prompt_embeds=embeds.prompt_embeds,
                pooled_prompt_embeds=embeds.pooled_prompt_embeds,
                num_inference_steps=params.num_inference_steps,
                guidance_scale=params.guidance_scale,
                width=params.width,
                height=params.height,
                generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np",
            )
            out.append((np.clip(result.images[0], 0, 1) * 255).round().astype(np.uint8))
    return out


def test_redux_requests_match_the_two_stage_recipe_alone_in_a_step_group(flux: DiffusersAdapter) -> None:
    images = {"one": [picture(1)], "two": [picture(2, (96, 80)), picture(3)], "late": [picture(4)]}
    one = request(
        flux, "a cat", (IPAdapterRef("look", images["one"][0]),), num_inference_steps=3, seed=1, n=2
    )
    two = request(
        flux,
        "a dog",
        (IPAdapterRef("look", images["two"][0], scale=0.5), IPAdapterRef("look", images["two"][1])),
        num_inference_steps=3,
        seed=2,
    )
    late = request(
        flux, "", (IPAdapterRef("look", images["late"][0], scale=0.8),), num_inference_steps=2, seed=3
    )
    # Reduced before queueing to what SigLIP's processor reads.
    assert two.ip_adapters[0].image.shape == (32, 32, 3)
    # `one`'s first image with another reference: no diffusers call, just rows in the forward.
    swapped = request(flux, "a cat", (IPAdapterRef("look", picture(5)),), num_inference_steps=3, seed=1)
    plain = request(flux, "a cat", (), num_inference_steps=3, seed=1)
    assert flux.step_key(one) == flux.step_key(two) != flux.step_key(plain)
    stepped = run_interleaved(flux, [one, two, late, swapped], [0, 0, 1, 0])
    # The tiny prior's reference moves the image well past rounding (issue 47).
    assert difference(stepped[one.request_id].images[0], stepped[swapped.request_id].images[0]) >= 8
    for name, redux in (("one", one), ("two", two), ("late", late)):
        alone = two_stage(redux, images[name])
        for image, expected in zip(stepped[redux.request_id].images, alone, strict=True):
            assert difference(image, expected) <= 1, name


def test_true_cfg_is_refused_with_redux(flux: DiffusersAdapter) -> None:
    refs = (IPAdapterRef("look", picture(1)),)
    with pytest.raises(InvalidRequestError) as refused:
        flux.validate_ip_adapters(refs, SamplingParams(negative_prompt="blurry", true_cfg_scale=2.0))
    assert refused.value.param == "negative_prompt"
    flux.validate_ip_adapters(refs, SamplingParams(negative_prompt="blurry", true_cfg_scale=1.0))
