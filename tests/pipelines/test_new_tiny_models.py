"""The tiny models of issue 24's families run their stock diffusers pipelines, offline.

They are built before any adapter serves them (`TinyModel.served` is False), so these tests
call diffusers directly: each model loads with `DiffusionPipeline.from_pretrained`, runs two
steps at 64x64, gives the same image for the same generator and another for another seed, and
the edit pipelines take one, two and (where allowed) three reference images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from pipelines.tiny import TINY_MODELS, tiny_model_dir

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    class_name: str
    # The call's reference-image argument and the numbers of images to try with it.
    reference: str | None = None
    references: tuple[int, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


CASES = {
    "tiny-flux2": Case("Flux2Pipeline", "image", (1, 2, 3)),
    "tiny-flux2-klein": Case("Flux2KleinPipeline", "image", (1, 2, 3)),
    "tiny-z-image": Case("ZImagePipeline"),
}


def pictures(count: int, size: int = 64) -> list[Image.Image]:
    """`count` different noise pictures, the smallest size every edit pipeline accepts."""
    return [
        Image.fromarray((np.random.RandomState(i).rand(size, size, 3) * 255).astype(np.uint8))
        for i in range(count)
    ]


def generate(
    pipe: DiffusionPipeline, case: Case, seed: int = 0, inputs: dict[str, Any] | None = None
) -> np.ndarray:
    result = pipe(
        prompt="a photo of a cat",
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **case.kwargs,
        **(inputs or {}),
    )
    images: np.ndarray = result.images
    return images


@pytest.fixture(scope="module")
def pipes() -> dict[str, DiffusionPipeline]:
    return {}


def loaded(pipes: dict[str, DiffusionPipeline], name: str) -> DiffusionPipeline:
    if name not in pipes:
        pipes[name] = DiffusionPipeline.from_pretrained(tiny_model_dir(name))
    return pipes[name]


def test_every_unserved_tiny_model_has_a_case() -> None:
    assert {name for name, model in TINY_MODELS.items() if not model.served} <= set(CASES)


@pytest.mark.parametrize("name", CASES)
def test_the_stock_pipeline_runs_and_is_deterministic(pipes: dict[str, DiffusionPipeline], name: str) -> None:
    case = CASES[name]
    pipe = loaded(pipes, name)
    assert type(pipe).__name__ == case.class_name
    first = generate(pipe, case)
    assert first.shape == (1, 64, 64, 3)
    np.testing.assert_array_equal(generate(pipe, case), first)
    assert np.abs(generate(pipe, case, seed=1) - first).max() > 0.1


@pytest.mark.parametrize(
    ("name", "count"),
    [(name, count) for name, case in CASES.items() for count in case.references],
)
def test_reference_images_enter_the_edit(pipes: dict[str, DiffusionPipeline], name: str, count: int) -> None:
    case = CASES[name]
    assert case.reference is not None
    pipe = loaded(pipes, name)
    plain = generate(pipe, case)
    edited = generate(pipe, case, inputs={case.reference: pictures(count)})
    assert edited.shape == (1, 64, 64, 3)
    np.testing.assert_array_equal(generate(pipe, case, inputs={case.reference: pictures(count)}), edited)
    # More than 1/255: a test can see a reference image reach (or miss) its request.
    assert np.abs(edited - plain).max() > 1 / 255
