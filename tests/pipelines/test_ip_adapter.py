"""IP-Adapter batched step by step (`pipelines.ip_adapter`): in one step group that mixes a
request without a reference image, a CFG request of two images at scale 1, one at scale 0.5
(its reference at another size, reduced before queueing) and one that joins at step 2,
each request's image equals diffusers' own `StableDiffusionPipeline(ip_adapter_image=...)`
run alone for it with `set_ip_adapter_scale(scale)`, within 1/255, and the request without
one equals the stock pipeline with no adapter loaded; the tiny IP-Adapter's reference image
visibly moves the image (issue 47)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from PIL import Image

from engine.request import GenerationRequest, InvalidRequestError, IPAdapterRef, RequestOutput, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.ip_adapter import weights_location
from pipelines.registry import load_pipeline
from pipelines.tiny.cache import tiny_model_dir
from tests.pipelines.engines import difference
from tests.pipelines.stock import call_arguments
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

ADAPTERS = (("style", "tiny-sd-ip-adapter"),)


@pytest.fixture(scope="module")
def sd() -> DiffusersAdapter:
    pipeline = load_pipeline(PipelineConfig(model="tiny-sd", num_threads=THREADS, ip_adapters=ADAPTERS))
    assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
    return pipeline


def fresh_pipe(sd: DiffusersAdapter) -> StableDiffusionPipeline:
    """diffusers' own pipeline over the model's weights from disk, nothing of ours loaded."""
    pipe = StableDiffusionPipeline.from_pretrained(tiny_model_dir("tiny-sd"))
    pipe.scheduler = type(sd.pipe.scheduler).from_config(sd.pipe.scheduler.config)
    return pipe


@pytest.fixture(scope="module")
def stock_pipe(sd: DiffusersAdapter) -> StableDiffusionPipeline:
    """The same, with the IP-Adapter loaded the way a diffusers user loads it."""
    pipe = fresh_pipe(sd)
    path, folder, weight = weights_location(ADAPTERS[0][1])
    pipe.load_ip_adapter(path, subfolder=folder, weight_name=weight)
    return pipe


def picture(seed: int, size: tuple[int, int] = (48, 48)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def request(
    sd: DiffusersAdapter, prompt: str, refs: tuple[IPAdapterRef, ...] = (), **fields: Any
) -> GenerationRequest:
    params = SamplingParams(width=64, height=64, **fields)
    created = GenerationRequest.create(prompt, params, ip_adapters=refs)
    created = created.with_params(sd.resolve(created))
    return sd.reduce_inputs(created)


def stock(
    sd: DiffusersAdapter,
    pipe: StableDiffusionPipeline,
    request: GenerationRequest,
    reference: np.ndarray | None,
) -> RequestOutput:
    """diffusers' call for `request` alone, one call per image, with the reference as sent."""
    kwargs = call_arguments(sd, request)
    if reference is not None:
        pipe.set_ip_adapter_scale(request.ip_adapters[0].scale)
        kwargs["ip_adapter_image"] = Image.fromarray(reference)
    out = []
    for seed in request.params.image_seeds():
        with torch.inference_mode():
            result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
        out.append((np.clip(result.images[0], 0, 1) * 255).round().astype(np.uint8))
    return RequestOutput(request.request_id, tuple(out), tuple(request.params.image_seeds()))


def test_referenced_requests_match_diffusers_alone_in_a_mixed_step_group(
    sd: DiffusersAdapter, stock_pipe: StableDiffusionPipeline
) -> None:
    references = {"full": picture(1), "half": picture(2, (96, 80)), "late": picture(3)}
    plain = request(sd, "a red cat", num_inference_steps=5, guidance_scale=7.5, seed=1)
    full = request(
        sd,
        "a cat on the moon",
        (IPAdapterRef("style", references["full"]),),
        num_inference_steps=6,
        guidance_scale=7.5,
        seed=2,
        n=2,
    )
    half = request(
        sd,
        "painting",
        (IPAdapterRef("style", references["half"], scale=0.5),),
        num_inference_steps=5,
        guidance_scale=5.0,
        seed=3,
    )
    late = request(
        sd,
        "the moon",
        (IPAdapterRef("style", references["late"], scale=0.8),),
        num_inference_steps=4,
        guidance_scale=1.0,
        seed=4,
    )
    # Reduced before queueing to what CLIP's feature extractor reads: its crop, as uint8.
    assert half.ip_adapters[0].image.shape == (32, 32, 3)
    stepped = run_interleaved(sd, [plain, full, half, late], [0, 0, 0, 2])
    for name, referenced in (("full", full), ("half", half), ("late", late)):
        alone = stock(sd, stock_pipe, referenced, references[name])
        for image, expected in zip(stepped[referenced.request_id].images, alone.images, strict=True):
            assert difference(image, expected) <= 1, name
    # Without a reference: the stock pipeline's image with no adapter loaded at all.
    alone_plain = stock(sd, fresh_pipe(sd), plain, None)
    assert difference(stepped[plain.request_id].images[0], alone_plain.images[0]) <= 1


def test_the_tiny_ip_adapters_reference_moves_the_image(sd: DiffusersAdapter) -> None:
    """Swapping one request's reference image for another's moves the image well past 1/255."""
    outputs = [
        run_interleaved(sd, [r], [0])[r.request_id].images[0]
        for r in (
            request(sd, "a cat", (IPAdapterRef("style", picture(seed)),), num_inference_steps=4, seed=7)
            for seed in (10, 11)
        )
    ]
    assert difference(outputs[0], outputs[1]) >= 8


def test_unknown_ip_adapters_are_refused_naming_the_field(sd: DiffusersAdapter) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        sd.validate_ip_adapters((IPAdapterRef("style", picture(1)), IPAdapterRef("face", picture(2))))
    assert refused.value.param == "ip_adapter[1].name"


def test_a_family_without_ip_adapters_refuses_the_flag_at_start() -> None:
    with pytest.raises(ValueError, match="takes no IP-Adapter"):
        load_pipeline(PipelineConfig(model="tiny-sd3", num_threads=THREADS, ip_adapters=ADAPTERS))
