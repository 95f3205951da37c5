"""The generic adapter: diffusers classes without a family (PixArt-Σ and Sana, tiny) are served
request-level, batched where their call takes lists, and each request equals its own stock
run; a family always wins; a class that cannot run here fails at start, saying why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.generic import GenericAdapter, GenericPipelineError
from pipelines.generic_call import CallSignature
from pipelines.registry import FAMILIES, adapter_for, adapter_for_model, load_pipeline
from tests.pipelines.engines import difference
from tests.threads import THREADS

GENERIC_MODELS = {"tiny-pixart-sigma": "PixArtSigmaPipeline", "tiny-sana": "SanaPipeline"}


class OnePromptPipeline:
    """A call that takes one prompt and one generator: no lists."""

    def __call__(self, prompt: str, generator: torch.Generator, num_inference_steps: int = 4) -> Any: ...


def test_the_call_signature_says_what_a_pipeline_takes() -> None:
    pixart = CallSignature.of(diffusers.PixArtSigmaPipeline)
    assert pixart.batches and pixart.refusal is None
    assert pixart.defaults == {
        "num_inference_steps": 20,
        "guidance_scale": 4.5,
        "height": None,
        "width": None,
    }
    # Its hint says one string: the negative prompt goes into the batch key.
    assert pixart.accepts("negative_prompt") and not pixart.negative_prompt_lists
    assert CallSignature.of(diffusers.SanaPipeline).defaults["width"] == 1024
    alone = CallSignature.of(OnePromptPipeline)
    assert not alone.batches and alone.refusal is None
    assert "one request per forward" in alone.describe()
    assert "image_embeds" in str(CallSignature.of(diffusers.KandinskyPipeline).refusal)
    assert "input image" in str(CallSignature.of(diffusers.StableDiffusionImg2ImgPipeline).refusal)


def test_a_family_always_wins_and_other_classes_get_the_generic_adapter() -> None:
    for family in FAMILIES:
        for use in family.uses:
            assert adapter_for_model(use.diffusers_class) is adapter_for(use.diffusers_class)
    assert adapter_for_model("PixArtSigmaPipeline") is GenericAdapter
    assert adapter_for_model("SanaPipeline") is GenericAdapter
    with pytest.raises(ValueError, match="no adapter serves FancyPipeline"):
        adapter_for_model("FancyPipeline")


def model_dir(tmp_path: Path, class_name: str) -> str:
    """A directory whose model index names `class_name` (no components: it never loads)."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("class_name", "reason"),
    [
        # diffusers' placeholder: sentencepiece is not installed on this machine.
        (
            "KolorsPipeline",
            "KolorsPipeline cannot be served here: it needs packages not installed here: .*sentencepiece",
        ),
        ("KandinskyPipeline", "KandinskyPipeline cannot be served here: its call requires image_embeds"),
        ("StableDiffusionImg2ImgPipeline", None),  # has a family: served by it, not refused
        (
            "UNet2DConditionModel",
            "UNet2DConditionModel cannot be served here: it is not a diffusers pipeline",
        ),
    ],
)
def test_a_class_that_cannot_run_here_fails_at_start_with_its_reason(
    tmp_path: Path, class_name: str, reason: str | None
) -> None:
    if reason is None:
        assert adapter_for_model(class_name) is not GenericAdapter
        return
    with pytest.raises(GenericPipelineError, match=reason):
        load_pipeline(PipelineConfig(model=model_dir(tmp_path, class_name)))


# Served models, each checked against its stock diffusers call ---------------------------------


@pytest.fixture(scope="module", params=list(GENERIC_MODELS))
def generic(request: pytest.FixtureRequest) -> Iterator[GenericAdapter]:
    pipeline = load_pipeline(PipelineConfig(model=request.param, num_threads=THREADS))
    assert isinstance(pipeline, GenericAdapter)
    assert type(pipeline.pipe).__name__ == GENERIC_MODELS[request.param]
    yield pipeline


def resolved(pipeline: GenericAdapter, prompt: str, **params: Any) -> GenerationRequest:
    request = GenerationRequest(prompt, prompt, SamplingParams(num_inference_steps=2, **params))
    request = replace(request, params=pipeline.resolve(request))
    pipeline.validate(request.params)
    return request


def stock(pipeline: GenericAdapter, request: GenerationRequest) -> list[np.ndarray]:
    """The request's images from its own stock diffusers call, one image at a time."""
    params = request.params
    images = []
    for seed in params.image_seeds():
        extra = {"negative_prompt": params.negative_prompt} if params.negative_prompt else {}
        result = pipeline.pipe(
            prompt=request.prompt,
            generator=torch.Generator("cpu").manual_seed(seed),
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            height=params.height,
            width=params.width,
            output_type="np",
            **extra,
        )
        images.append((np.clip(result.images[0], 0, 1) * 255).round().astype(np.uint8))
    return images


@pytest.mark.slow
def test_batched_requests_each_equal_their_stock_run_alone(generic: GenericAdapter) -> None:
    assert generic.supports_request_batch and not generic.supports_step_batch
    requests = [resolved(generic, "a red cat", seed=1), resolved(generic, "a house on a hill", seed=2, n=2)]
    assert generic.batch_key(requests[0]) == generic.batch_key(requests[1])
    outputs = generic.forward(RequestBatch(key=generic.batch_key(requests[0]), requests=tuple(requests)))
    for request, output in zip(requests, outputs, strict=True):
        assert output.request_id == request.request_id and len(output.images) == request.params.n
        for served, expected in zip(output.images, stock(generic, request), strict=True):
            assert difference(served, expected) <= 1


@pytest.mark.slow
def test_one_request_per_forward_where_the_call_takes_no_lists(generic: GenericAdapter) -> None:
    # The same pipeline, as if its hints admitted one prompt only.
    generic.family.signature = replace(generic.signature, prompt_lists=False)
    try:
        assert not generic.supports_request_batch
        request = resolved(generic, "the moon", seed=3, negative_prompt="blurry")
        (output,) = generic.forward(RequestBatch(key=generic.batch_key(request), requests=(request,)))
        assert difference(output.images[0], stock(generic, request)[0]) <= 1
    finally:
        generic.family.signature = replace(generic.signature, prompt_lists=True)


@pytest.mark.slow
def test_negative_prompts_one_string_per_call_are_in_the_key(generic: GenericAdapter) -> None:
    first, second = (resolved(generic, "a cat", seed=1, negative_prompt=n) for n in ("blurry", "dark"))
    assert generic.batch_key(first) != generic.batch_key(second)
    assert generic.batch_key(first) != generic.batch_key(resolved(generic, "a cat", seed=1))
    with pytest.raises(InvalidRequestError, match="multiple of"):
        generic.validate(replace(first.params, width=60))
