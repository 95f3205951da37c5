"""Multi-reference edits (Qwen-Image-Edit-Plus 2509 and 2511): text-to-image plus one or
more input images per request, which the denoiser sees as extra tokens after the noise.

The family says how big each reference is in the denoiser's sequence (`reference_sizes`)
and where the output size comes from when the request sets none (`reference_output_size`).
Rotary embeddings are computed from the first row's layout, so rows of one forward must
share the output size and every reference's size: the layout is in the step key. Prompts,
seeds, steps, guidance and negative prompts are per request, so requests with different
pictures of the same sizes step together even where diffusers' own call refuses batches.

Request level, a use with `one_image_per_call` runs one request per call with all its
images as sent.
"""

from __future__ import annotations

from typing import Any, ClassVar

from PIL import Image

from engine.request import GenerationRequest, RequestBatch
from pipelines.base import Modality
from pipelines.outputs import resolved
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.family import TaskFamily


class MultiReferenceEdit(Task):
    name: ClassVar[str] = "multi-reference-edit"
    suffix: ClassVar[str] = "Edit"
    modality: ClassVar[Modality] = "edit"
    input_images: ClassVar[tuple[int, int]] = (1, 3)
    # Only used when a request has no input image, which admission refuses.
    default_size: ClassVar[tuple[int, int] | None] = (1024, 1024)
    needs: ClassVar[tuple[str, ...]] = ("reference_latents", "reference_sizes", "reference_output_size")

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        if not request.input_images or family.config.default_size:
            return None
        return family.reference_output_size(request)

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (family.reference_sizes(request) if request.input_images else None,)

    def step_key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (family.reference_sizes(request),)

    def step_cost(self, family: TaskFamily, request: GenerationRequest, cost: int) -> int:
        # Each row carries its references' tokens after its own (the budget's default
        # request has no image: it is taken to bring one of its output size).
        params = request.params
        if not request.input_images:
            return 2 * cost
        output = resolved(params.width) * resolved(params.height)
        references = sum(width * height for width, height in family.reference_sizes(request))
        return cost * (output + references) // output

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        # diffusers refuses batches of prompts here: one request per call (`one_image_per_call`).
        (request,) = batch.requests
        return {"image": [Image.fromarray(image) for image in request.input_images]}

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        generators = generators_for(request)
        latents = family.reference_latents(request, generators, prompts)
        return family.state(request, family.scheduler(request), latents, generators, prompts)


MULTI_REFERENCE_EDIT = MultiReferenceEdit()
