"""IP-Adapter batched step by step (`pipelines.ip_adapter`, `pipelines.ip_adapter_flux`), for
Stable Diffusion 1.x and SDXL, text-to-image, image-to-image and inpainting, and FLUX.1
text-to-image: in one step group that mixes a request without a
reference image, a CFG request of two images at scale 1 (FLUX: true CFG, whose negative rows
get diffusers' black `negative_ip_adapter_image`), one at scale 0.5 (its reference at
another size, reduced before queueing) and one with no prompt (as a variation is drawn) that
joins at step 2, each request's image equals diffusers' own pipeline of its task (such as
`StableDiffusionXLPipeline(ip_adapter_image=...)`) run alone for it with
`set_ip_adapter_scale(scale)`, within 1/255, and the request without one equals the stock
pipeline with no adapter loaded; each tiny IP-Adapter's reference image visibly moves the
image (issue 47)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from engine.request import (
    GenerationRequest,
    InvalidRequestError,
    IPAdapterRef,
    LoraRef,
    RequestOutput,
    SamplingParams,
)
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.ip_adapter import weights_location
from pipelines.ip_adapter_flux import image_encoder_location
from pipelines.registry import load_pipeline
from pipelines.tiny.cache import tiny_model_dir
from pipelines.tiny.lora import tiny_lora_dir
from tests.pipelines.engines import difference
from tests.pipelines.stock import call_arguments, kept_outside_mask
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# The tiny IP-Adapter that fits each model's UNet.
TINY_IP_ADAPTER = {
    "tiny-sd": "tiny-sd-ip-adapter",
    "tiny-sd-inpaint": "tiny-sd-ip-adapter",  # tiny-sd's UNet but its 9 input channels
    "tiny-sdxl": "tiny-sdxl-ip-adapter",
    "tiny-flux": "tiny-flux-ip-adapter",
}
# Each case: (model, pipeline class). Each task once, each family's text-to-image, and both
# ways of inpainting: an inpainting checkpoint (its UNet reads the mask) and text-to-image
# weights through diffusers' inpainting pipeline (the input put back outside the mask after
# each step). The tasks add nothing of their own to a reference (`Family.takes_ip_adapter`),
# so the other pairs (SD 4-channel inpainting, SDXL image-to-image) are left out for time.
CASES = {
    "sd": ("tiny-sd", None),
    "sdxl": ("tiny-sdxl", None),
    "sd-image-to-image": ("tiny-sd", "pipelines.registry:StableDiffusionImageToImage"),
    "sd-inpainting-9-channel": ("tiny-sd-inpaint", None),
    "sdxl-inpainting": ("tiny-sdxl", "pipelines.registry:StableDiffusionXLInpaint"),
    "flux": ("tiny-flux", None),
}
# The guidance that has a negative branch: FLUX's true CFG (a negative prompt and
# `true_cfg_scale` > 1); Stable Diffusion's guidance scale.
GUIDED = {"flux": {"negative_prompt": "blurry", "true_cfg_scale": 2.0}}


@dataclass(frozen=True)
class Served:
    """A model served with its tiny IP-Adapter as `style`, and diffusers' own pipeline of its
    task over the same weights from disk, with the IP-Adapter loaded the way a diffusers user
    loads it (`stock`) and without (`fresh`)."""

    case: str
    pipeline: DiffusersAdapter
    stock: Any
    fresh: Any


@pytest.fixture(scope="module", params=list(CASES))
def served(request: pytest.FixtureRequest) -> Served:
    model, pipeline_class = CASES[request.param]
    adapters = (("style", TINY_IP_ADAPTER[model]),)
    config = PipelineConfig(
        model=model, pipeline_class=pipeline_class, num_threads=THREADS, ip_adapters=adapters
    )
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
    stock = fresh_pipe(pipeline, model)
    path, folder, weight = weights_location(adapters[0][1])
    if model == "tiny-flux":  # its image encoder is named, and loads in float16 unless told
        encoder = {"image_encoder_pretrained_model_name_or_path": image_encoder_location(adapters[0][1])}
        stock.load_ip_adapter(
            path, subfolder=folder, weight_name=weight, **encoder, image_encoder_dtype=torch.float32
        )
    else:
        stock.load_ip_adapter(path, subfolder=folder, weight_name=weight)
    return Served(request.param, pipeline, stock, fresh_pipe(pipeline, model))


def fresh_pipe(pipeline: DiffusersAdapter, model: str) -> DiffusionPipeline:
    """diffusers' pipeline of the adapter's task over the model's weights from disk, nothing
    of ours loaded."""
    pipe = type(pipeline.pipe).from_pretrained(tiny_model_dir(model))
    pipe.scheduler = type(pipeline.pipe.scheduler).from_config(pipeline.pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def picture(seed: int, size: tuple[int, int] = (48, 48)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def task_inputs(case: str) -> dict[str, Any]:
    """An edit's input image, and its strength or its mask."""
    if case in ("sd", "sdxl", "flux"):
        return {}
    inputs: dict[str, Any] = {"input_images": (picture(20, (64, 64)),)}
    if "inpainting" in case:
        mask = np.zeros((64, 64), np.uint8)
        mask[16:48, 8:40] = 255  # diffusers' convention: white is repainted
        inputs["mask"] = mask
    else:
        inputs["strength"] = 0.75
    return inputs


def request(
    pipeline: DiffusersAdapter, prompt: str, refs: tuple[IPAdapterRef, ...] = (), **fields: Any
) -> GenerationRequest:
    inputs = {name: fields.pop(name) for name in ("input_images", "mask") if name in fields}
    params = SamplingParams(width=64, height=64, **fields)
    created = GenerationRequest.create(prompt, params, ip_adapters=refs, **inputs)
    created = created.with_params(pipeline.resolve(created))
    return pipeline.reduce_inputs(created)


def stock(served: Served, request: GenerationRequest, reference: np.ndarray | None) -> RequestOutput:
    """diffusers' call for `request` alone, one call per image, with the reference as sent
    (none: the pipeline without the adapter loaded)."""
    kwargs = call_arguments(served.pipeline, request)
    pipe = served.fresh
    if reference is not None:
        pipe = served.stock
        pipe.set_ip_adapter_scale(request.ip_adapters[0].scale)
        kwargs["ip_adapter_image"] = Image.fromarray(reference)
    out = []
    for seed in request.params.image_seeds():
        with torch.inference_mode():
            result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
        image = (np.clip(result.images[0], 0, 1) * 255).round().astype(np.uint8)
        out.append(kept_outside_mask(request, image))
    return RequestOutput(request.request_id, tuple(out), tuple(request.params.image_seeds()))


def test_referenced_requests_match_diffusers_alone_in_a_mixed_step_group(served: Served) -> None:
    sd, inputs = served.pipeline, task_inputs(served.case)
    references = {"full": picture(1), "half": picture(2, (96, 80)), "late": picture(3)}
    plain = request(sd, "a red cat", num_inference_steps=5, guidance_scale=7.5, seed=1, **inputs)
    full = request(
        sd,
        "a cat on the moon",
        (IPAdapterRef("style", references["full"]),),
        num_inference_steps=6,
        guidance_scale=7.5,
        seed=2,
        n=1 if inputs else 2,  # each image's own embedding rows: text-to-image shows it, for time
        **GUIDED.get(served.case, {}),
        **inputs,
    )
    half = request(
        sd,
        "painting",
        (IPAdapterRef("style", references["half"], scale=0.5),),
        num_inference_steps=5,
        guidance_scale=5.0,
        seed=3,
        **inputs,
    )
    # No prompt, as /v1/images/variations draws with an IP-Adapter.
    late = request(
        sd,
        "",
        (IPAdapterRef("style", references["late"], scale=0.8),),
        num_inference_steps=4,
        guidance_scale=1.0,
        seed=4,
        **inputs,
    )
    # Reduced before queueing to what CLIP's feature extractor reads: its crop, as uint8.
    assert half.ip_adapters[0].image.shape == (32, 32, 3)
    stepped = run_interleaved(sd, [plain, full, half, late], [0, 0, 0, 2])
    for name, referenced in (("full", full), ("half", half), ("late", late)):
        alone = stock(served, referenced, references[name])
        for image, expected in zip(stepped[referenced.request_id].images, alone.images, strict=True):
            assert difference(image, expected) <= 1, (served.case, name)
    # Without a reference: the stock pipeline's image with no adapter loaded at all.
    alone_plain = stock(served, plain, None)
    assert difference(stepped[plain.request_id].images[0], alone_plain.images[0]) <= 1


def test_referenced_requests_with_a_lora_match_diffusers_with_the_adapter_loaded() -> None:
    """IP-Adapter with LoRA: a referenced request and a plain one with LoRA adapter "a" (at
    0.7) share steps, the plain one joining mid-way; each equals diffusers' pipeline alone into
    which diffusers itself loaded the LoRA adapter (and the IP-Adapter, for the referenced one)."""
    config = PipelineConfig(
        model="tiny-sd",
        num_threads=THREADS,
        ip_adapters=(("style", "tiny-sd-ip-adapter"),),
        lora_modules=(("a", "tiny-lora-1"),),
    )
    sd = load_pipeline(config)
    assert isinstance(sd, DiffusersAdapter)
    lora, reference = LoraRef("a", 0.7), picture(1)
    refs = (IPAdapterRef("style", reference, scale=0.8),)
    referenced = request(sd, "a cat", refs, num_inference_steps=4, guidance_scale=7.5, seed=2, lora=lora)
    plain = request(sd, "a red cat", num_inference_steps=4, guidance_scale=7.5, seed=1, lora=lora)
    stepped = run_interleaved(sd, [referenced, plain], [0, 1])

    with_ip, without_ip = fresh_pipe(sd, "tiny-sd"), fresh_pipe(sd, "tiny-sd")
    path, folder, weight = weights_location("tiny-sd-ip-adapter")
    with_ip.load_ip_adapter(path, subfolder=folder, weight_name=weight)
    for pipe in (with_ip, without_ip):
        pipe.load_lora_weights(str(tiny_lora_dir("tiny-lora-1", "tiny-sd")), adapter_name="a")
        pipe.set_adapters(["a"], [0.7])
    reference_pipes = Served("sd", sd, with_ip, without_ip)
    for sent, image in ((referenced, reference), (plain, None)):
        alone = stock(reference_pipes, sent, image)
        assert difference(stepped[sent.request_id].images[0], alone.images[0]) <= 1
    # The adapter shows: the plain request's image is not the model's without it.
    without_lora = stock(Served("sd", sd, with_ip, fresh_pipe(sd, "tiny-sd")), plain, None)
    assert difference(stepped[plain.request_id].images[0], without_lora.images[0]) >= 8


@pytest.mark.parametrize("served", ["sd", "sdxl", "flux"], indirect=True)
def test_the_tiny_ip_adapters_reference_moves_the_image(served: Served) -> None:
    """Swapping one request's reference image for another's moves the image well past 1/255."""
    sd = served.pipeline
    outputs = [
        run_interleaved(sd, [r], [0])[r.request_id].images[0]
        for r in (
            request(sd, "a cat", (IPAdapterRef("style", picture(seed)),), num_inference_steps=4, seed=7)
            for seed in (10, 11)
        )
    ]
    assert difference(outputs[0], outputs[1]) >= 8


@pytest.mark.parametrize("served", ["sd"], indirect=True)
def test_unknown_ip_adapters_are_refused_naming_the_field(served: Served) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        served.pipeline.validate_ip_adapters(
            (IPAdapterRef("style", picture(1)), IPAdapterRef("face", picture(2))), SamplingParams()
        )
    assert refused.value.param == "ip_adapter[1].name"


def test_a_family_without_ip_adapters_refuses_the_flag_at_start() -> None:
    adapters = (("style", "tiny-sd-ip-adapter"),)
    with pytest.raises(ValueError, match="takes no IP-Adapter"):
        load_pipeline(PipelineConfig(model="tiny-sd3", num_threads=THREADS, ip_adapters=adapters))


@pytest.mark.parametrize("served", ["flux"], indirect=True)
def test_flux_ip_adapters_refuse_the_first_block_cache(served: Served) -> None:
    """Its per-row image attention sits in the blocks that the first-block cache cuts to fewer
    rows; TaylorSeer leaves whole requests out of the forward, which the rows follow."""
    assert "IP-Adapters" in (served.pipeline.cache_refusal("first-block") or "")
    assert served.pipeline.cache_refusal("taylorseer") is None
