"""Reference edits (Qwen-Image-Edit): text-to-image plus the request's input image, which the
text encoder reads beside the prompt and the denoiser sees as a second image.

QwenImageEditPipeline resizes the condition image to about 1024x1024 pixels keeping its
aspect ratio, and in a batched call it sizes every condition image from the first one. So
requests share a forward only when their input images give the same condition size (it
is in the batch key); their output size defaults to that size, as in diffusers.

Step-level, following `QwenImageEditPipeline.__call__`: the text encoder reads each prompt
with its own input image (resized to the condition size), the VAE encodes that image once
per request into packed "image latents" (`TaskFamily.reference_latents`), and every step runs
the denoiser on the noisy latents followed by the image latents and keeps the prediction
for the noisy part only. The condition size sets the sequence length, so it is in the step
key; steps, guidance and negative prompts are per request.

A use with `one_image_per_call` (Qwen-Image-Edit-Plus: several input images per request)
runs one request per forward, request-level, with all its images as sent.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from engine.request import GenerationRequest, RequestBatch
from pipelines.base import Modality
from pipelines.outputs import resolved
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.family import TaskFamily

# The area QwenImageEditPipeline resizes its condition image to.
_CONDITION_AREA = 1024 * 1024
# The input image's packed latents, in the conditioning of both guidance halves.
IMAGE_LATENTS = "image_latents"


def condition_size(image: np.ndarray) -> tuple[int, int]:
    """(width, height) the pipeline gives the condition image made from `image`."""
    height, width = image.shape[:2]
    # diffusers' function read from its module at each call, as the stock call reads it
    # (tests that shrink the area wrap it there: `small_edit_references` in tests/pipelines/conftest.py).
    dimensions = pipeline_qwenimage_edit.calculate_dimensions(_CONDITION_AREA, width / height)
    calculated_width, calculated_height, _ = dimensions
    return int(calculated_width), int(calculated_height)


def condition_image(family: TaskFamily, request: GenerationRequest) -> Image.Image:
    """The input image at the condition size, as the pipeline resizes it."""
    width, height = condition_size(request.input_images[0])
    resized: Image.Image = family.pipe.image_processor.resize(
        Image.fromarray(request.input_images[0]), height, width
    )
    return resized


class ReferenceEdit(Task):
    name: ClassVar[str] = "reference-edit"
    suffix: ClassVar[str] = "Edit"
    modality: ClassVar[Modality] = "edit"
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    # Only used when a request has no input image, which admission refuses; an edit's
    # default size comes from its input image (`size_from_inputs`).
    default_size: ClassVar[tuple[int, int] | None] = (1024, 1024)
    needs: ClassVar[tuple[str, ...]] = ("reference_latents",)

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        if not request.input_images or family.config.default_size:
            return None
        return condition_size(request.input_images[0])

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (condition_size(request.input_images[0]) if request.input_images else None,)

    def step_key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (condition_size(request.input_images[0]),)

    def step_cost(self, family: TaskFamily, request: GenerationRequest, cost: int) -> int:
        # Each row carries the condition image's tokens after its own (the budget's default
        # request has no image: its condition is taken to be its output size).
        params = request.params
        if not request.input_images:
            return 2 * cost
        width, height = condition_size(request.input_images[0])
        output = resolved(params.width) * resolved(params.height)
        return cost * (output + width * height) // output

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        if family.use.one_image_per_call:
            (request,) = batch.requests
            return {"image": [Image.fromarray(image) for image in request.input_images]}
        # One input image per generated image, in the order prompts were expanded, already at
        # the condition size: given a list, diffusers would show the text encoder the images
        # as sent, where the stock call with one image shows it the resized one.
        images = [
            condition_image(family, request) for request in batch.requests for _ in range(request.params.n)
        ]
        return {"image": images}

    def prompt_inputs(self, family: TaskFamily, owners: list[GenerationRequest]) -> dict[str, Any]:
        # The text encoder reads each prompt with its request's image at the condition size.
        return {"image": [condition_image(family, request) for request in owners]}

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        generators = generators_for(request)
        latents = family.reference_latents(request, generators, prompts)
        return family.state(request, family.scheduler(request), latents, generators, prompts)


REFERENCE_EDIT = ReferenceEdit()
