"""Inpainting and image-to-image served step-level, over the tiny models: every request's
images match the stock diffusers pipeline (the img2img pipelines of SD, SDXL — its refiner
too —, FLUX and Qwen-Image; the inpainting pipelines of SD and SDXL, over inpainting
checkpoints and over text-to-image weights, and of FLUX and Qwen-Image — the request-level
`forward` is its own `__call__`) run alone with the same seed and parameters,
within 1/255, while requests with different strengths, step counts, guidance (some
without), inputs, masks and n share steps and join at different steps; on SD with each
stateful scheduler kind. Previews work for them too."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from diffusers import (
    ChromaInpaintPipeline,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)
from PIL import Image

from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.tasks import inpainting as inpainting_task
from tests.media import picture
from tests.pipelines.edit_families import IMAGE_TO_IMAGE, INPAINTING
from tests.pipelines.test_stepping import preview_decoder, run_alone, stepped_matches_alone
from tests.threads import THREADS

pytestmark = pytest.mark.slow

FAMILIES = {**IMAGE_TO_IMAGE, **INPAINTING}
_LOADED: dict[str, DiffusersAdapter] = {}

# (family, scheduler class or None for the model's own): every family, and on SD every
# stateful scheduler kind (image-to-image begins part-way through each one's schedule;
# Euler's inputs are scaled, and an inpainting UNet's mask channels must not be).
SCHEDULERS = [
    DDIMScheduler,
    EulerDiscreteScheduler,
    EulerAncestralDiscreteScheduler,
    PNDMScheduler,
    DPMSolverMultistepScheduler,
    UniPCMultistepScheduler,
]
CASES = [
    *[("sd-img2img", cls) for cls in SCHEDULERS],
    ("sd-inpaint", None),
    ("sd-inpaint", EulerDiscreteScheduler),
    # Text-to-image weights: the input goes back outside the mask after each step, noised by
    # the request's own scheduler (ancestral: the generators' order matters after prepare).
    ("sd-inpaint-4ch", None),
    ("sd-inpaint-4ch", EulerAncestralDiscreteScheduler),
    ("sd-inpaint-4ch", DPMSolverMultistepScheduler),
    ("sdxl-inpaint", None),
    ("sdxl-inpaint-4ch", None),
    ("sdxl-img2img", None),
    ("sdxl-img2img", EulerDiscreteScheduler),
    ("sdxl-refiner", None),
    ("flux-img2img", None),
    ("qwen-image-img2img", None),
    ("flux-inpaint", None),
    ("qwen-image-inpaint", None),
    ("z-image-img2img", None),
    ("z-image-inpaint", None),
    ("chroma-img2img", None),
    ("chroma-inpaint", None),
]


def loaded(family: str) -> DiffusersAdapter:
    if family not in _LOADED:
        pipeline = load_pipeline(FAMILIES[family])
        assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
        _LOADED[family] = pipeline
    return _LOADED[family]


def box(top: int, left: int, bottom: int, right: int) -> np.ndarray:
    """A 48x64 mask in diffusers' convention (255 = repaint) with one box to repaint."""
    mask = np.zeros((48, 64), np.uint8)
    mask[top:bottom, left:right] = 255
    return mask


# Output sizes (width, height) for the families that step rows of different sizes in one
# forward (`Family.mixes_sizes_in`); every other family's requests are 64x48.
MIXED_SIZES = [(64, 48), (48, 48), (64, 64), (32, 48), (64, 32)]
MIXING = {
    "flux-img2img",
    "flux-inpaint",
    "chroma-img2img",
    "chroma-inpaint",
    "z-image-img2img",
    "z-image-inpaint",
}


def mixed_requests(
    pipeline: DiffusersAdapter, rng: random.Random, sizes: list[tuple[int, int]] | None = None
) -> list[GenerationRequest]:
    """Strengths that start the schedules at different steps (None: the default 0.8), step
    counts that share no timesteps, guidance with and without CFG, a negative prompt (with a
    true CFG scale of its own on Qwen-Image), n, input pictures of different sizes (served at
    64x48, or at five sizes where the family mixes them, in one step key) and masks (one
    request without: repaint everything)."""
    shapes = [
        (8, 0.5, 7.5, None, 1, box(8, 16, 40, 48)),
        (5, 0.3, 1.0, None, 2, box(0, 0, 24, 64)),
        (9, 1.0, 5.0, "ugly, blurry", 1, None),
        (6, None, 3.0, None, 2, box(16, 8, 48, 24)),
        (4, 0.9, 0.0, "x", 1, box(24, 32, 40, 64)),
    ]
    inpainting = pipeline.task is inpainting_task.INPAINTING
    sizes = sizes or [(64, 48)] * len(shapes)
    requests = []
    for i, ((steps, strength, guidance, negative, n, mask), (width, height)) in enumerate(
        zip(shapes, sizes, strict=True)
    ):
        prompt = " ".join(rng.choice(["a", "red", "cat", "on", "the", "moon"]) for _ in range(1 + 3 * i))
        true_cfg = 2.5 if negative and pipeline.default_true_cfg_scale is not None else None
        params = SamplingParams(
            width=width,
            height=height,
            num_inference_steps=steps,
            strength=None if inpainting else strength,
            guidance_scale=guidance,
            true_cfg_scale=true_cfg,
            negative_prompt=negative,
            n=n,
            seed=rng.randrange(1000),
        )
        image = picture(64 + 16 * i, 48 + 8 * i, seed=i)
        request = GenerationRequest.create(
            prompt, params, input_images=(image,), mask=mask if inpainting else None
        )
        request = request.with_params(pipeline.resolve(request))
        pipeline.validate(request.params)
        requests.append(request)
    assert len({pipeline.step_key(r) for r in requests}) == 1  # one step group, whatever the sizes
    return requests


@pytest.mark.parametrize(
    ("family", "scheduler_class"), CASES, ids=[f"{f}-{c.__name__ if c else 'own'}" for f, c in CASES]
)
def test_each_edit_matches_the_stock_pipeline_alone(family: str, scheduler_class: Any) -> None:
    sizes = MIXED_SIZES if family in MIXING else None
    stepped = stepped_matches_alone(
        loaded(family), scheduler_class, lambda pipeline, rng: mixed_requests(pipeline, rng, sizes)
    )
    served = {(height, width, 3) for width, height in sizes or [(64, 48)]}
    assert {output.images[0].shape for output in stepped.values()} == served


@pytest.mark.parametrize("family", list(IMAGE_TO_IMAGE))
def test_strength_decides_where_a_schedule_starts_not_whom_it_steps_with(family: str) -> None:
    pipeline = loaded(family)
    requests = mixed_requests(pipeline, random.Random(1))
    assert len({pipeline.step_key(r) for r in requests}) == 1
    assert len({pipeline.batch_key(r) for r in requests}) == len(requests)  # strength, steps, ...
    states = pipeline.prepare(requests)
    # diffusers' get_timesteps: SD and SDXL redraw int(steps x strength) steps, the flow
    # models (FLUX, Qwen-Image) skip int(steps x (1 - strength)).
    expected = [4, 1, 9, 4, 3] if family.startswith("sd") else [4, 2, 9, 5, 4]
    assert [state.total_steps for state in states] == expected


def test_too_little_strength_for_its_steps_is_refused() -> None:
    pipeline = loaded("sd-img2img")
    request = GenerationRequest.create(
        "x", SamplingParams(num_inference_steps=4, strength=0.2), input_images=(picture(64, 48, 1),)
    )
    with pytest.raises(ValueError, match="strength") as raised:
        pipeline.validate(pipeline.resolve(request))
    assert getattr(raised.value, "param", None) == "strength"


def test_a_four_channel_unet_inpaints_through_the_inpainting_pipeline_step_level() -> None:
    """Text-to-image weights named with `pipeline_class` load through the family's
    inpainting pipeline (diffusers blends their latents with the input after each step)."""
    for family in ("sd-inpaint-4ch", "sdxl-inpaint-4ch"):
        pipeline = loaded(family)
        assert type(pipeline.pipe).__name__.endswith("InpaintPipeline")
        assert pipeline.pipe.unet.config.in_channels == 4 and pipeline.supports_step_batch


@pytest.mark.parametrize(
    "family", ["qwen-image-img2img", "sd-inpaint", "sd-inpaint-4ch", "qwen-image-inpaint"]
)
def test_previews_converge_keep_the_unmasked_input_and_change_nothing(family: str) -> None:
    """Image-to-image previews begin part-way through the schedule (a flow model's estimate
    needs the sigma of the schedule's own step); inpainting previews show the input outside
    the mask, as the final image does."""
    pipeline = loaded(family)
    assert isinstance(pipeline, DiffusersAdapter)
    inpainting = pipeline.task is inpainting_task.INPAINTING
    mask = box(8, 16, 40, 48)
    runs = []
    with preview_decoder(pipeline, "vae"):
        for partial_images in (0, 3):
            params = SamplingParams(
                num_inference_steps=12,
                seed=3,
                n=2,
                partial_images=partial_images,
                strength=None if inpainting else 0.5,
            )
            request = GenerationRequest.create(
                "a red cat", params, input_images=(picture(64, 48, 9),), mask=mask if inpainting else None
            )
            runs.append(run_alone(pipeline, request.with_params(pipeline.resolve(request))))
    (no_previews, plain), (previews, output) = runs
    assert no_previews == []
    assert [step for step, _ in previews] == ([3, 6, 9] if inpainting else [2, 3, 4])  # of 12 or 6
    for plain_image, image in zip(plain.images, output.images, strict=True):
        assert (plain_image == image).all()  # previews change nothing
    for i, final in enumerate(output.images):
        errors = [np.abs(images[i].astype(float) - final.astype(float)).mean() for _, images in previews]
        assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0], errors
        if inpainting:
            keep = mask == 0
            assert all((images[i][keep] == final[keep]).all() for _, images in previews)


def test_chroma_inpainting_loads_with_the_flag_its_stock_call_reads() -> None:
    """diffusers 0.42.1's ChromaInpaintPipeline call reads `transformer.config.guidance_embeds`
    (for a guidance input its loop never uses), which Chroma's transformer config has not: the
    stock call fails as it comes. The loader registers the flag (False: Chroma has no
    guidance embedding), which is all the stepped-equals-stock case above runs against."""
    text_to_image = load_pipeline(PipelineConfig(model="tiny-chroma", num_threads=THREADS))
    assert isinstance(text_to_image, DiffusersAdapter)
    stock = ChromaInpaintPipeline.from_pipe(text_to_image.pipe)
    with pytest.raises(AttributeError, match="guidance_embeds"):
        stock(
            prompt="a cat",
            image=Image.fromarray(picture(64, 48, 1)),
            mask_image=Image.fromarray(box(8, 16, 40, 48)),
            height=48,
            width=64,
            num_inference_steps=1,
        )
    assert loaded("chroma-inpaint").pipe.transformer.config.guidance_embeds is False
