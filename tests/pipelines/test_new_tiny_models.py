"""The tiny models of issue 24's families run their stock diffusers pipelines, offline.

Most are built before any adapter serves them (`TinyModel.served` is False), so these tests call
diffusers directly: each model loads with `DiffusionPipeline.from_pretrained` (the Qwen-VL ones
with an image-only processor passed in: no torchvision here), runs two steps at 64x64, gives the
same image for the same generator, another for another seed and a visibly different one for
another prompt, and the edit pipelines take one, two and three reference images.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from pipelines.qwen_edit_loading import load_qwen_image_21, load_qwen_image_edit
from pipelines.tiny import TINY_MODELS, tiny_model_dir

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    class_name: str
    # The call's reference-image argument and the numbers of images to try with it.
    reference: str | None = None
    references: tuple[int, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    load: Callable[[str], DiffusionPipeline] = DiffusionPipeline.from_pretrained
    # How far two different reference sets must move the image: more than 1/255 lets a test see
    # a reference reach (or miss) its request.
    reference_effect: float = 1 / 255


def load_without_torchvision(path: str) -> DiffusionPipeline:
    """`from_pretrained` with the Qwen2-VL processor built without a video processor."""
    return load_qwen_image_edit(path, torch.float32)


def pictures(count: int, first: int = 0, size: int = 64) -> list[Image.Image]:
    """`count` different noise pictures, the smallest size every edit pipeline accepts."""
    return [
        Image.fromarray((np.random.RandomState(i).rand(size, size, 3) * 255).astype(np.uint8))
        for i in range(first, first + count)
    ]


def left_half() -> Image.Image:
    """A mask that repaints the left half."""
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[:, :32] = 255
    return Image.fromarray(mask)


CASES = {
    "tiny-flux2": Case("Flux2Pipeline", "image", (1, 2, 3)),
    "tiny-flux2-klein": Case("Flux2KleinPipeline", "image", (1, 2, 3)),
    "tiny-z-image": Case("ZImagePipeline"),
    # Kontext scales the request to `max_area` and, with `_auto_resize`, the reference to ~1 MP.
    "tiny-flux-kontext": Case(
        "FluxKontextPipeline", "image", (1,), {"max_area": 64 * 64, "_auto_resize": False}
    ),
    "tiny-flux-fill": Case(
        "FluxFillPipeline", "image", (1,), {"image": pictures(1)[0], "mask_image": left_half()}
    ),
    "tiny-chroma": Case("ChromaPipeline", kwargs={"negative_prompt": "oil painting"}),
    # References are resized to output_resolution**2 pixels (1024**2 by default); see its builder
    # for why they move the image so little.
    "tiny-qwen-image-21": Case(
        "QwenImage21Pipeline",
        "image",
        (1, 2, 3),
        {"output_resolution": 64},
        load_qwen_image_21,
        reference_effect=1e-4,
    ),
    "tiny-ovis-image": Case("OvisImagePipeline", kwargs={"negative_prompt": "oil painting"}),
    # Both snap sizes to aspect-ratio bins unless told not to; PixArt's caption cleaning needs bs4.
    "tiny-pixart-sigma": Case(
        "PixArtSigmaPipeline", kwargs={"use_resolution_binning": False, "clean_caption": False}
    ),
    "tiny-sana": Case("SanaPipeline", kwargs={"use_resolution_binning": False, "clean_caption": False}),
    # Each reference image is resized to about 1024x1024 for the VAE: seconds per call.
    "tiny-qwen-image-edit-2511": Case(
        "QwenImageEditPlusPipeline", "image", (1, 2, 3), {"image": pictures(1)[0]}, load_without_torchvision
    ),
}


def generate(
    pipe: DiffusionPipeline, case: Case, seed: int = 0, inputs: dict[str, Any] | None = None
) -> np.ndarray:
    result = pipe(
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **{"prompt": "a photo of a cat", **case.kwargs, **(inputs or {})},
    )
    images: np.ndarray = result.images
    return images


@pytest.fixture(scope="module")
def pipes() -> dict[str, DiffusionPipeline]:
    return {}


def loaded(pipes: dict[str, DiffusionPipeline], name: str) -> DiffusionPipeline:
    if name not in pipes:
        pipes[name] = CASES[name].load(str(tiny_model_dir(name)))
    return pipes[name]


def test_edit_2511_modulates_its_references_at_timestep_zero(pipes: dict[str, DiffusionPipeline]) -> None:
    assert loaded(pipes, "tiny-qwen-image-edit-2511").transformer.config.zero_cond_t


def test_every_unserved_tiny_image_model_has_a_case() -> None:
    # The unserved video models have theirs in test_new_tiny_video_models.py.
    unserved = {name for name, model in TINY_MODELS.items() if not model.served}
    assert unserved <= set(CASES)


@pytest.mark.parametrize("name", CASES)
def test_the_stock_pipeline_runs_and_is_deterministic(pipes: dict[str, DiffusionPipeline], name: str) -> None:
    case = CASES[name]
    pipe = loaded(pipes, name)
    assert type(pipe).__name__ == case.class_name
    first = generate(pipe, case)
    assert first.shape[:3] == (1, 64, 64)  # Qwen-Image 2.1's images are RGBA.
    np.testing.assert_array_equal(generate(pipe, case), first)
    assert np.abs(generate(pipe, case, seed=1) - first).max() > 0.1
    # More than 1/255: a test can see a prompt reach (or miss) its request.
    assert (
        np.abs(generate(pipe, case, inputs={"prompt": "a dog running through a field"}) - first).max()
        > 1 / 255
    )


@pytest.mark.parametrize(
    ("name", "count"),
    [(name, count) for name, case in CASES.items() for count in case.references],
)
def test_reference_images_enter_the_edit(pipes: dict[str, DiffusionPipeline], name: str, count: int) -> None:
    case = CASES[name]
    assert case.reference is not None
    pipe = loaded(pipes, name)
    many = case.references != (1,)  # Single-image pipelines take the image itself.
    edited = generate(pipe, case, inputs={case.reference: pictures(count) if many else pictures(1)[0]})
    assert edited.shape[:3] == (1, 64, 64)
    other = generate(pipe, case, inputs={case.reference: pictures(count, 3) if many else pictures(1, 3)[0]})
    assert np.abs(other - edited).max() > case.reference_effect


@pytest.mark.parametrize("class_name", ["ZImageImg2ImgPipeline", "ZImageInpaintPipeline"])
def test_z_image_edits_run_on_the_text_to_image_components(class_name: str) -> None:
    """Z-Image's img2img and inpainting pipelines load the same directory, directly or `from_pipe`."""
    pipeline_class = getattr(diffusers, class_name)
    directory = tiny_model_dir("tiny-z-image")
    inputs: dict[str, Any] = {"image": pictures(1)[0], "strength": 0.9}
    if class_name == "ZImageInpaintPipeline":
        inputs["mask_image"] = left_half()
    case = Case(class_name)
    direct = generate(pipeline_class.from_pretrained(directory), case, inputs=inputs)
    text_to_image = DiffusionPipeline.from_pretrained(directory)
    shared = generate(pipeline_class.from_pipe(text_to_image), case, inputs=inputs)
    assert direct.shape == (1, 64, 64, 3)
    np.testing.assert_array_equal(shared, direct)
