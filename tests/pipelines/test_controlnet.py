"""ControlNet batched step by step (`pipelines.controlnet`, `pipelines.controlnet_flux`): each
request's image equals diffusers' own `StableDiffusionControlNetPipeline`,
`StableDiffusionXLControlNetPipeline` or `FluxControlNetPipeline` (or their multi-ControlNet
form) run alone for it, within 1/255, in a step group that mixes a request without control,
other scales and windows, two ControlNets at once and a request that joins mid-way (FLUX.1:
also other image sizes, true CFG and a union ControlNet's rows of different modes); the same
for image-to-image and inpainting (SD's and SDXL's 4- and 9-channel UNets, FLUX.1's
text-to-image weights) against diffusers' `StableDiffusionControlNetImg2ImgPipeline`,
`StableDiffusionControlNetInpaintPipeline`, `StableDiffusionXLControlNetImg2ImgPipeline`,
`StableDiffusionXLControlNetInpaintPipeline`, `FluxControlNetImg2ImgPipeline` and
`FluxControlNetInpaintPipeline`; Qwen-Image's text-to-image against
`QwenImageControlNetPipeline` (a request naming its ControlNet twice:
`QwenImageMultiControlNetModel`); each tiny ControlNet's control image visibly moves the image
(issue 47); a union ControlNet's `mode` is checked naming the field. SDXL's union ControlNet
(one pass per request fusing its images, one or two modes) matches
`StableDiffusionXLControlNetUnionPipeline` alone in a step group with plain requests."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    FluxControlNetImg2ImgPipeline,
    FluxControlNetInpaintPipeline,
    FluxControlNetPipeline,
    FluxMultiControlNetModel,
    MultiControlNetModel,
    QwenImageControlNetPipeline,
    QwenImageMultiControlNetModel,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionControlNetInpaintPipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionXLControlNetImg2ImgPipeline,
    StableDiffusionXLControlNetInpaintPipeline,
    StableDiffusionXLControlNetPipeline,
    StableDiffusionXLControlNetUnionPipeline,
)
from PIL import Image

from engine.request import (
    ControlRef,
    GenerationRequest,
    InvalidRequestError,
    LoraRef,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.tiny.cache import tiny_model_dir
from pipelines.tiny.controlnet import build_tiny_controlnet, build_tiny_controlnet_union
from pipelines.tiny.lora import tiny_lora_dir
from tests.pipelines.engines import difference
from tests.pipelines.stock import call_arguments, kept_outside_mask, stock_output
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# Two names, one tiny ControlNet: a request may use both, each with its own image and scale.
CONTROLNETS = (("edges", "tiny-sd-controlnet"), ("depth", "tiny-sd-controlnet"))
# The tiny ControlNet that fits each model's UNet.
TINY_CONTROLNET = {
    "tiny-sd": "tiny-sd-controlnet",
    "tiny-sdxl": "tiny-sdxl-controlnet",
    "tiny-flux": "tiny-flux-controlnet",
    "tiny-qwen-image": "tiny-qwen-image-controlnet",
}


@pytest.fixture(scope="module", params=list(TINY_CONTROLNET))
def sd(request: pytest.FixtureRequest) -> DiffusersAdapter:
    """A text-to-image model with the ControlNets: Stable Diffusion 1.x, SDXL, FLUX.1 (its
    `guidance_scale` is the distilled guidance: none of these requests has negative rows),
    Qwen-Image (true CFG for the request with a negative prompt)."""
    return served(request.param)


# The edit tasks, each with the ControlNets: (model, pipeline class).
EDITS = {
    "image-to-image": ("tiny-sd", "pipelines.registry:StableDiffusionImageToImage"),
    # A 9-channel inpainting UNet (its ControlNet reads the 4 latent channels)...
    "inpainting": ("tiny-sd-inpaint", None),
    # ... and text-to-image weights, the input put back outside the mask after each step.
    "inpainting-4-channel": ("tiny-sd", "pipelines.registry:StableDiffusionInpaint"),
    "sdxl-image-to-image": ("tiny-sdxl", "pipelines.registry:StableDiffusionXLImageToImage"),
    # (SDXL's text-to-image weights inpaint through the code SD's do: not repeated here.)
    "sdxl-inpainting": ("tiny-sdxl-inpaint", None),
    "flux-image-to-image": ("tiny-flux", "pipelines.registry:FluxImageToImage"),
    "flux-inpainting": ("tiny-flux", "pipelines.registry:FluxInpaint"),
}


def served(model: str, pipeline_class: str | None = None) -> DiffusersAdapter:
    source = TINY_CONTROLNET[model.removesuffix("-inpaint")]  # an inpainting UNet: its base's
    controlnets = tuple((name, source) for name, _ in CONTROLNETS)
    if model in ("tiny-flux", "tiny-sdxl"):  # and a union ControlNet: a mode per entry
        controlnets += (("union", f"{model}-controlnet-union"),)
    config = PipelineConfig(
        model=model, pipeline_class=pipeline_class, num_threads=THREADS, controlnets=controlnets
    )
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
    return pipeline


def picture(seed: int, size: tuple[int, int] = (64, 64)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def request(
    sd: DiffusersAdapter, prompt: str, controls: tuple[ControlRef, ...] = (), **fields: Any
) -> GenerationRequest:
    inputs = {name: fields.pop(name) for name in ("input_images", "mask") if name in fields}
    params = SamplingParams(**({"width": 64, "height": 64} | fields))
    created = GenerationRequest.create(prompt, params, controls=controls, **inputs)
    created = created.with_params(sd.resolve(created))
    return sd.reduce_inputs(created)


# The ControlNet pipeline of each task, and what its call names the control image.
_STOCK = {
    "StableDiffusionPipeline": (StableDiffusionControlNetPipeline, "image"),
    "StableDiffusionImg2ImgPipeline": (StableDiffusionControlNetImg2ImgPipeline, "control_image"),
    "StableDiffusionInpaintPipeline": (StableDiffusionControlNetInpaintPipeline, "control_image"),
    "StableDiffusionXLPipeline": (StableDiffusionXLControlNetPipeline, "image"),
    "StableDiffusionXLImg2ImgPipeline": (StableDiffusionXLControlNetImg2ImgPipeline, "control_image"),
    "StableDiffusionXLInpaintPipeline": (StableDiffusionXLControlNetInpaintPipeline, "control_image"),
    "FluxPipeline": (FluxControlNetPipeline, "control_image"),
    "FluxImg2ImgPipeline": (FluxControlNetImg2ImgPipeline, "control_image"),
    "FluxInpaintPipeline": (FluxControlNetInpaintPipeline, "control_image"),
    "QwenImagePipeline": (QwenImageControlNetPipeline, "control_image"),
}


_SDXL_FLAGS = ("force_zeros_for_empty_prompt", "requires_aesthetics_score")


def stock(sd: DiffusersAdapter, request: GenerationRequest) -> RequestOutput:
    """diffusers' ControlNet pipeline of the adapter's task over the same components, one
    call per image."""
    nets = sd.family.controlnets
    assert nets is not None
    used = [nets.nets[control.name] for control in request.controls]
    if sd.control_modes.get(request.controls[0].name) and sd.fuses_union:
        return _stock_union(sd, request)
    multi = len(used) > 1
    pipeline_class, image_argument = _STOCK[type(sd.pipe).__name__]
    flux = pipeline_class.__name__.startswith("Flux")
    takes = set(inspect.signature(pipeline_class.__init__).parameters) - {"image_encoder"}
    multi_class = FluxMultiControlNetModel if flux else MultiControlNetModel
    if pipeline_class is QwenImageControlNetPipeline:
        # diffusers' Qwen-Image multi-ControlNet runs one model once per image: the names here
        # are one tiny ControlNet loaded twice, so the first stands for both.
        sources = dict(sd.config.controlnets)
        assert len({sources[control.name] for control in request.controls}) == 1
        multi_class, used = QwenImageMultiControlNetModel, used[:1]
    pipe = pipeline_class(
        **{name: part for name, part in sd.pipe.components.items() if name in takes},
        controlnet=multi_class(used) if multi else used[0],
        **({"requires_safety_checker": False} if "safety_checker" in sd.pipe.components else {}),
        # SDXL's: as the model's own pipeline was saved (zero negatives, a refiner's scores).
        **{name: sd.pipe.config[name] for name in _SDXL_FLAGS if name in takes and name in sd.pipe.config},
    )
    pipe.scheduler = type(sd.pipe.scheduler).from_config(sd.pipe.scheduler.config)
    images = [Image.fromarray(control.image) for control in request.controls]
    scales = [control.scale for control in request.controls]
    starts = [control.start for control in request.controls]
    ends = [control.end for control in request.controls]
    kwargs = call_arguments(sd, request) | {
        image_argument: images if multi else images[0],
        "controlnet_conditioning_scale": scales if multi else scales[0],
        "control_guidance_start": starts if multi else starts[0],
        "control_guidance_end": ends if multi else ends[0],
    }
    modes = [control.mode for control in request.controls]
    if flux and multi:
        # A mode per ControlNet (None where it is not a union one); FLUX's img2img and
        # inpainting pipelines run no ControlNet at all unless the list is given.
        kwargs["control_mode"] = modes
    elif modes[0] is not None:
        kwargs["control_mode"] = modes[0]
    out = []
    for seed in request.params.image_seeds():
        with torch.inference_mode():
            result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
        image = (np.clip(result.images[0], 0, 1) * 255).round().astype(np.uint8)
        out.append(kept_outside_mask(request, image))
    return RequestOutput(request.request_id, tuple(out), tuple(request.params.image_seeds()))


def _stock_union(sd: DiffusersAdapter, request: GenerationRequest) -> RequestOutput:
    """`StableDiffusionXLControlNetUnionPipeline` with the one union ControlNet, the request's
    images, modes, scales and windows as lists (one entry each), one call per image."""
    nets = sd.family.controlnets
    assert nets is not None and type(sd.pipe).__name__ == "StableDiffusionXLPipeline"
    takes = set(inspect.signature(StableDiffusionXLControlNetUnionPipeline.__init__).parameters)
    pipe = StableDiffusionXLControlNetUnionPipeline(
        **{name: part for name, part in sd.pipe.components.items() if name in takes - {"image_encoder"}},
        controlnet=nets.nets[request.controls[0].name],
        force_zeros_for_empty_prompt=sd.pipe.config.force_zeros_for_empty_prompt,
    )
    pipe.scheduler = type(sd.pipe.scheduler).from_config(sd.pipe.scheduler.config)
    controls = request.controls
    kwargs = call_arguments(sd, request) | {
        "control_image": [Image.fromarray(control.image) for control in controls],
        "control_mode": [control.mode for control in controls],
        "controlnet_conditioning_scale": [control.scale for control in controls],
        "control_guidance_start": [control.start for control in controls],
        "control_guidance_end": [control.end for control in controls],
    }
    out = []
    for seed in request.params.image_seeds():
        with torch.inference_mode():
            result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
        out.append((np.clip(result.images[0], 0, 1) * 255).round().astype(np.uint8))
    return RequestOutput(request.request_id, tuple(out), tuple(request.params.image_seeds()))


def controlled_group(sd: DiffusersAdapter) -> list[GenerationRequest]:
    """A plain request, a guided one of two images under one ControlNet, an unguided one
    steered in a window by a control image of another size, and one under two ControlNets
    (`CONTROLLED_JOINS`: the last joins mid-way)."""
    plain = request(sd, "a red cat", num_inference_steps=5, guidance_scale=7.5, seed=1)
    full = request(
        sd,
        "a cat on the moon",
        (ControlRef("edges", picture(1)),),
        num_inference_steps=6,
        guidance_scale=7.5,
        negative_prompt="blurry",  # Qwen-Image's true CFG (scale 4); FLUX.1's stays off (1)
        seed=2,
        n=2,
    )
    # No CFG rows, a window, a control image at another size (resized before queueing).
    window = request(
        sd,
        "painting",
        (ControlRef("edges", picture(2, (96, 80)), scale=0.6, start=0.2, end=0.7),),
        num_inference_steps=5,
        guidance_scale=1.0,
        seed=3,
    )
    # Two ControlNets, joining mid-way.
    both = request(
        sd,
        "the moon",
        (ControlRef("edges", picture(3), scale=1.3), ControlRef("depth", picture(4), scale=0.5, end=0.5)),
        num_inference_steps=4,
        guidance_scale=5.0,
        seed=4,
    )
    return [plain, full, window, both]


# The step each of `controlled_group`'s requests joins at.
CONTROLLED_JOINS = [0, 0, 1, 3]


def test_controlled_requests_match_diffusers_alone_in_a_mixed_step_group(sd: DiffusersAdapter) -> None:
    requests = controlled_group(sd)
    plain, window = requests[0], requests[2]
    assert window.controls[0].image.shape == (64, 64, 3)
    stepped = run_interleaved(sd, requests, CONTROLLED_JOINS)
    for controlled in requests[1:]:
        alone = stock(sd, controlled)
        for image, reference in zip(stepped[controlled.request_id].images, alone.images, strict=True):
            assert difference(image, reference) <= 1, controlled.params
    # The uncontrolled request is the stock text-to-image image, unmoved by its neighbours.
    alone_plain = run_interleaved(sd, [plain], [0])[plain.request_id]
    assert difference(stepped[plain.request_id].images[0], alone_plain.images[0]) <= 1


@pytest.mark.parametrize("task", list(EDITS))
def test_controlled_edits_match_diffusers_alone_in_a_mixed_step_group(task: str) -> None:
    """Image-to-image and inpainting: a plain edit, a controlled one with a window, and one
    with two ControlNets joining mid-way share steps; each is diffusers' ControlNet pipeline
    of its task alone."""
    edit = served(*EDITS[task])
    inputs: dict[str, Any] = {"input_images": (picture(20),)}
    if "inpainting" in task:
        mask = np.zeros((64, 64), np.uint8)
        mask[16:48, 8:40] = 255  # diffusers' convention: white is repainted
        inputs["mask"] = mask
    else:
        inputs["strength"] = 0.75
    plain = request(edit, "a red cat", num_inference_steps=5, guidance_scale=7.5, seed=1, **inputs)
    window = request(
        edit,
        "painting",
        (ControlRef("edges", picture(2, (96, 80)), scale=0.7, start=0.25, end=0.8),),
        num_inference_steps=6,
        guidance_scale=6.0,
        seed=3,
        n=2,
        **inputs,
    )
    both = request(
        edit,
        "the moon",
        (ControlRef("edges", picture(3), scale=1.3), ControlRef("depth", picture(4), scale=0.5, end=0.5)),
        num_inference_steps=4,
        guidance_scale=1.0,
        seed=4,
        **inputs,
    )
    requests = [plain, window, both]
    stepped = run_interleaved(edit, requests, [0, 0, 2])
    for controlled in requests[1:]:
        alone = stock(edit, controlled)
        for image, reference in zip(stepped[controlled.request_id].images, alone.images, strict=True):
            assert difference(image, reference) <= 1, (task, controlled.params)
    alone_plain = run_interleaved(edit, [plain], [0])[plain.request_id]
    assert difference(stepped[plain.request_id].images[0], alone_plain.images[0]) <= 1


def test_flux_controlled_requests_match_diffusers_alone_across_sizes_and_true_cfg() -> None:
    """FLUX.1: rows of three sizes share each step (padded to one grid); a request with true CFG
    (its negative rows take its positive rows' residuals, as the pipeline reuses them), a window,
    two ControlNets joining mid-way, a union ControlNet on rows of three modes in one forward (one
    request naming it twice with two modes, joining mid-way); each is `FluxControlNetPipeline`
    alone (with its `control_mode`), and the request without control `FluxPipeline` alone."""
    flux = served("tiny-flux")
    plain = request(flux, "a red cat", num_inference_steps=5, guidance_scale=3.5, seed=1)
    cfg = request(
        flux,
        "a cat on the moon",
        (ControlRef("edges", picture(1, (48, 64)), scale=0.8),),
        width=64,
        height=48,
        num_inference_steps=5,
        negative_prompt="blurry",
        true_cfg_scale=2.0,
        seed=2,
        n=2,
    )
    window = request(
        flux,
        "painting",
        (ControlRef("depth", picture(2, (96, 80)), scale=0.6, start=0.2, end=0.7),),
        width=32,
        height=64,
        num_inference_steps=6,
        guidance_scale=5.0,
        seed=3,
    )
    both = request(
        flux,
        "the moon",
        (ControlRef("edges", picture(3), scale=1.3), ControlRef("depth", picture(4), scale=0.5, end=0.5)),
        num_inference_steps=4,
        seed=4,
    )
    # The same request but for its mode, twice.
    modes = [
        request(
            flux,
            "a cat",
            (ControlRef("union", picture(5), scale=0.9, mode=mode),),
            num_inference_steps=4,
            seed=5,
        )
        for mode in (0, 2)
    ]
    two_modes = request(
        flux,
        "the sea",
        (
            ControlRef("union", picture(6), mode=1),
            ControlRef("union", picture(7), scale=0.5, start=0.25, mode=3),
        ),
        num_inference_steps=5,
        seed=6,
    )
    requests = [plain, cfg, window, both, *modes, two_modes]
    stepped = run_interleaved(flux, requests, [0, 0, 1, 2, 0, 0, 1])
    for controlled in requests[1:]:
        alone = stock(flux, controlled)
        for image, reference in zip(stepped[controlled.request_id].images, alone.images, strict=True):
            assert difference(image, reference) <= 1, controlled.params
    assert difference(stepped[plain.request_id].images[0], stock_output(flux, plain).images[0]) <= 1
    # The mode steers: the same image and seed in another mode draws another image.
    assert difference(*(stepped[r.request_id].images[0] for r in modes)) >= 8


def test_sdxl_union_requests_match_diffusers_alone_in_a_mixed_step_group(sd: DiffusersAdapter) -> None:
    """SDXL's union ControlNet fuses each request's images in one pass: a plain request, a
    request of a plain ControlNet, union requests of one mode (two scales and modes, sharing
    one pass) and one of two modes with their own scales and a window, joining mid-way, share
    each step; each is `StableDiffusionXLControlNetUnionPipeline` alone. The control image and
    the mode each move the tiny union ControlNet's image."""
    if type(sd.pipe).__name__ != "StableDiffusionXLPipeline":
        pytest.skip("SDXL's union ControlNet")
    plain = request(sd, "a red cat", num_inference_steps=3, guidance_scale=5.0, seed=1)
    edges = request(sd, "a dog", (ControlRef("edges", picture(1)),), num_inference_steps=3, seed=2)
    one_mode = [
        request(
            sd,
            "a cat on the moon",
            (ControlRef("union", picture(image), scale=scale, mode=mode),),
            num_inference_steps=3,
            guidance_scale=guidance,
            seed=3,
        )
        for image, scale, mode, guidance in ((2, 0.8, 3, 5.0), (2, 1.0, 1, 1.0), (3, 0.8, 3, 5.0))
    ]
    two_modes = request(
        sd,
        "the sea",
        (
            ControlRef("union", picture(4), scale=1.2, mode=0),
            ControlRef("union", picture(5), scale=0.5, start=0.34, mode=5),
        ),
        num_inference_steps=3,
        seed=4,
    )
    requests = [plain, edges, *one_mode, two_modes]
    stepped = run_interleaved(sd, requests, [0, 0, 0, 1, 0, 1])
    for controlled in (edges, *one_mode[:2], two_modes):  # (the third differs by its image only)
        alone = stock(sd, controlled)
        for image, reference in zip(stepped[controlled.request_id].images, alone.images, strict=True):
            assert difference(image, reference) <= 1, controlled.controls
    alone_plain = run_interleaved(sd, [plain], [0])[plain.request_id]
    assert difference(stepped[plain.request_id].images[0], alone_plain.images[0]) <= 1
    first, other_mode, other_image = (stepped[r.request_id].images[0] for r in one_mode)
    assert difference(first, other_image) >= 8  # the control image steers
    assert difference(first, other_mode) >= 8  # and its mode (with another scale and no CFG)


@pytest.mark.parametrize("build", [build_tiny_controlnet, build_tiny_controlnet_union])
def test_the_tiny_sdxl_controlnets_build_the_same_bytes_every_time(
    tmp_path: Path, build: Callable[[Path, Path], None]
) -> None:
    """Their layers drawn at construction are seeded, whatever the process drew before."""
    base = tiny_model_dir("tiny-sdxl")
    built = []
    for name in ("a", "b"):
        build(base, tmp_path / name)
        built.append((tmp_path / name / "diffusion_pytorch_model.safetensors").read_bytes())
    assert built[0] == built[1]


def test_a_request_level_batch_with_control_runs_the_stages_to_the_end() -> None:
    """Request mode: a batch holding a controlled request runs the family's own stages (every
    request from its first step to its last); each image is diffusers' own alone, the controlled
    one `QwenImageControlNetPipeline`'s, the plain one `QwenImagePipeline`'s."""
    qwen = served("tiny-qwen-image")
    plain = request(qwen, "a red cat", num_inference_steps=3, seed=1)
    controlled = request(
        qwen, "the moon", (ControlRef("edges", picture(1), scale=0.7),), num_inference_steps=3, seed=2
    )
    # Control images do not split request-level batches: the stages take them per row.
    assert qwen.batch_key(plain) == qwen.batch_key(controlled)
    batch = RequestBatch(key=qwen.batch_key(plain), requests=(plain, controlled))
    outputs = qwen.forward(batch)
    assert [output.request_id for output in outputs] == [plain.request_id, controlled.request_id]
    assert difference(outputs[0].images[0], stock_output(qwen, plain).images[0]) <= 1
    assert difference(outputs[1].images[0], stock(qwen, controlled).images[0]) <= 1


def test_controlled_requests_with_a_lora_match_diffusers_with_the_adapter_loaded() -> None:
    """LoRA with control: a controlled request and a plain one with adapter "a" (at 0.7) share
    steps, one joining mid-way; a controlled request without an adapter steps on its own (the
    adapter is part of the step key). Each equals diffusers' ControlNet pipeline alone over a
    fresh copy of the model into which diffusers itself loaded the adapter."""
    loras = (("a", "tiny-lora-1"),)
    config = PipelineConfig(
        model="tiny-sd", num_threads=THREADS, controlnets=CONTROLNETS[:1], lora_modules=loras
    )
    sd = load_pipeline(config)
    assert isinstance(sd, DiffusersAdapter)
    lora = LoraRef("a", 0.7)
    edges = (ControlRef("edges", picture(1), scale=0.8),)
    with_lora = request(sd, "a red cat", edges, num_inference_steps=3, seed=1, lora=lora)
    plain_lora = request(sd, "a dog", num_inference_steps=3, seed=2, lora=lora)
    without = request(sd, "a red cat", edges, num_inference_steps=3, seed=1)
    stepped = run_interleaved(sd, [with_lora, plain_lora], [0, 1])
    stepped |= run_interleaved(sd, [without], [0])

    reference = served("tiny-sd")  # the same ControlNets, no adapter
    alone_without = stock(reference, without)
    reference.pipe.load_lora_weights(str(tiny_lora_dir("tiny-lora-1", "tiny-sd")), adapter_name="a")
    reference.pipe.set_adapters(["a"], [0.7])
    for sent in (with_lora, without):
        alone = alone_without if sent is without else stock(reference, sent)
        assert difference(stepped[sent.request_id].images[0], alone.images[0]) <= 1
    plain_alone = stock_output(reference, plain_lora)
    assert difference(stepped[plain_lora.request_id].images[0], plain_alone.images[0]) <= 1
    # The adapter shows in the controlled image.
    assert difference(stepped[with_lora.request_id].images[0], stepped[without.request_id].images[0]) >= 8


def test_the_tiny_controlnets_image_moves_the_image(sd: DiffusersAdapter) -> None:
    """Swapping one request's control image for another's moves the image well past 1/255."""
    outputs = [
        run_interleaved(sd, [r], [0])[r.request_id].images[0]
        for r in (
            request(sd, "a cat", (ControlRef("edges", picture(seed)),), num_inference_steps=4, seed=7)
            for seed in (10, 11)
        )
    ]
    assert difference(outputs[0], outputs[1]) >= 8


def test_unknown_controlnets_are_refused_naming_the_field(sd: DiffusersAdapter) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        sd.validate_controls((ControlRef("edges", picture(1)), ControlRef("pose", picture(2))))
    assert refused.value.param == "controlnet[1].name"


def test_a_mode_is_checked_naming_the_field(sd: DiffusersAdapter) -> None:
    """A `mode` only for a union ControlNet, which needs one of its own modes; admission checks
    on the weightless copy the engine's process holds (`spec()`)."""
    spec = sd.spec()
    edges = ControlRef("edges", picture(1))
    with pytest.raises(InvalidRequestError) as refused:
        spec.validate_controls((edges, ControlRef("edges", picture(2), mode=0)))
    assert refused.value.param == "controlnet[1].mode"
    if "union" not in spec.control_modes:  # FLUX.1's and SDXL's only
        return
    last = spec.control_modes["union"] - 1  # tiny-flux-controlnet-union's 3, tiny-sdxl's 5
    union = ControlRef("union", picture(2), mode=last)
    for mode in (None, last + 1):
        with pytest.raises(InvalidRequestError, match=f"0 to {last}") as refused:
            spec.validate_controls((union, ControlRef("union", picture(2), mode=mode)))
        assert refused.value.param == "controlnet[1].mode"
    if spec.fuses_union:  # SDXL's fuses a request's images: no other ControlNet beside it
        with pytest.raises(InvalidRequestError, match="names no other ControlNet") as refused:
            spec.validate_controls((union, edges))
        assert refused.value.param == "controlnet[1].name"
        spec.validate_controls((union, ControlRef("union", picture(3), mode=0)))
    else:
        spec.validate_controls((edges, union))


def test_a_family_without_controlnet_refuses_the_flag_at_start() -> None:
    with pytest.raises(ValueError, match="takes no ControlNet"):
        load_pipeline(PipelineConfig(model="tiny-sd3", num_threads=THREADS, controlnets=CONTROLNETS))
