"""Reference images as extra tokens (FLUX.2, FLUX.1-Kontext): text-to-image whose denoiser
also sees each reference image's VAE latents, packed like the noise and appended after it
with position ids of their own, and predicts for the noise tokens only.

`REFERENCES` (FLUX.2, Qwen-Image 2.1): none to the family's maximum of images per request, on both
`/v1/images/generations` (none) and `/v1/images/edits` (one or more). `REFERENCE`
(FLUX.1-Kontext): exactly one, an edit.

The family says how its pipeline sizes each reference (`TaskFamily.reference_sizes`) and the
output (`TaskFamily.reference_output_size`), reduces a large one before the queue
(`TaskFamily.reduce_references`), and makes their tokens (`TaskFamily.add_references`). The
transformers take their rotary positions from the first row of a forward, so rows share a
forward only when their output size and their references' sizes, in order, are equal: both
are in the step key. Prompt, seed, steps and guidance stay per row.

Request-level, diffusers takes ONE list of references for the whole call (repeated over its
prompts): requests share a call only when their images are the very same (their digest is in
the key).
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

from PIL import Image

from engine.request import GenerationRequest, RequestBatch
from pipelines.base import Modality
from pipelines.outputs import resolved
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.family import TaskFamily

# The references' packed latents and their position ids, per row, in both conditionings.
REFERENCE_LATENTS = "reference_latents"
REFERENCE_IDS = "reference_ids"


def inputs_digest(request: GenerationRequest) -> str:
    """The request's input images' digest: the engine's (`engine.core.inputs`), or made here for a
    request that did not come through it."""
    if request.input_digest is not None:
        return request.input_digest
    digest = hashlib.sha256()
    for image in request.input_images:
        digest.update(repr(image.shape).encode())
        digest.update(image.tobytes())
    return digest.hexdigest()


class References(Task):
    name: ClassVar[str] = "references"
    suffix: ClassVar[str] = "References"
    # Served on both image endpoints: without references it is text-to-image.
    modality: ClassVar[Modality] = "image+edit"
    # The family's use declares its own maximum.
    input_images: ClassVar[tuple[int, int]] = (0, 1)
    needs: ClassVar[tuple[str, ...]] = ("reference_sizes", "reference_output_size", "add_references")

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        # As diffusers sizes it from the references (FLUX: the first's size), where the
        # request sets none.
        if not request.input_images or family.config.default_size:
            return None
        return family.reference_output_size(request)

    def reduce_inputs(self, family: TaskFamily, request: GenerationRequest) -> GenerationRequest:
        # As the family's pipeline first reduces each reference, before it waits in the queue.
        return family.reduce_references(request)

    def check_inputs(self, family: TaskFamily, request: GenerationRequest) -> None:
        family.check_references(request)

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (inputs_digest(request) if request.input_images else None,)

    def step_key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (family.reference_sizes(request),)

    def step_cost(self, family: TaskFamily, request: GenerationRequest, cost: int) -> int:
        # Each row carries its references' tokens after its own.
        output = resolved(request.params.width) * resolved(request.params.height)
        extra = sum(width * height for width, height in family.reference_sizes(request))
        return cost * (output + extra) // output

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        # Every request of the batch has the same images (the digest is in the key).
        images = batch.requests[0].input_images
        if not images:
            return {}
        pictures = [Image.fromarray(image) for image in images]
        return {"image": pictures if len(pictures) > 1 else pictures[0], **family.reference_call_kwargs()}

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        generators = generators_for(request)
        scheduler = family.scheduler(request)
        latents = family.noise(request, scheduler, generators, prompts[0])
        if request.input_images:
            family.add_references(request, prompts)
        return family.state(request, scheduler, latents, generators, prompts)


class Reference(References):
    """Exactly one reference: an edit (FLUX.1-Kontext)."""

    name: ClassVar[str] = "reference"
    suffix: ClassVar[str] = "Reference"
    modality: ClassVar[Modality] = "edit"
    input_images: ClassVar[tuple[int, int]] = (1, 1)


REFERENCES = References()
REFERENCE = Reference()
