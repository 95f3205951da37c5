"""Image-to-image: `strength` says how much of the input image is redrawn. A family serves it
through diffusers' img2img pipeline over its text-to-image weights (`from_pipe`).

Request-level: one input image goes to diffusers per generated image, so requests batch
by the usual key plus `strength` (diffusers takes one per call).

Step-level, drawn as the family's diffusers pipeline draws them (the generators in the same
order, so a request's image is the one the stock pipeline makes for it alone): its own
schedule begins part-way (`get_timesteps`: strength 0.6 of 10 steps takes the last 6) from
the input's VAE latents, sampled with the request's generators and noised to that first
timestep. So requests of any strength, input image, steps and guidance share a step; the
strength is not in the step key.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.base import Modality
from pipelines.outputs import resolved
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.family import TaskFamily
from pipelines.tasks.image_input import input_at_size, input_pixels, size_of_input

# diffusers' default for its img2img pipelines.
DEFAULT_STRENGTH = 0.8


class ImageToImage(Task):
    name: ClassVar[str] = "image-to-image"
    suffix: ClassVar[str] = "ImageToImage"
    modality: ClassVar[Modality] = "edit"
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    accepts_strength: ClassVar[bool] = True
    from_pipe: ClassVar[bool] = True
    needs: ClassVar[tuple[str, ...]] = ("encode_image",)

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        return size_of_input(family, request)

    def complete(self, family: TaskFamily, params: SamplingParams) -> SamplingParams:
        return params if params.strength is not None else replace(params, strength=DEFAULT_STRENGTH)

    def validate(self, family: TaskFamily, params: SamplingParams) -> None:
        steps, strength = resolved(params.num_inference_steps), resolved(params.strength)
        if family.skipped_steps(steps, strength) >= steps:
            raise InvalidRequestError(
                f"strength {strength} leaves none of the {steps} steps to take: raise strength "
                "or num_inference_steps",
                "strength",
            )

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        # diffusers takes one strength per call; step-level, strength only decides where a
        # request's own schedule starts, so it is not in the step key.
        return (request.params.strength,)

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"strength": params.strength}

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        images = [
            Image.fromarray(input_at_size(request))
            for request in batch.requests
            for _ in range(request.params.n)
        ]
        return {"image": images}

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        """As the img2img pipelines' `prepare_latents`: the input's VAE latents sampled with
        each generator, then noise from the same generators, mixed at the first timestep of
        the request's own schedule."""
        generators = generators_for(request)
        controls = family.control_images(request, generators)  # before any draw, as diffusers
        scheduler = family.scheduler(request)
        first = start_at_strength(family, request, scheduler)
        dtype = prompts[0]["encoder_hidden_states"].dtype
        pixels = input_pixels(family, request)
        with family.vae_lock:  # a decode may be running beside
            image = family.encode_image(request, pixels, generators, dtype)
        noise = randn_tensor(image.shape, generator=generators, device=family.device, dtype=dtype)
        latents = family.pack(family.noised(scheduler, image, noise, first), request)
        state = family.state(request, scheduler, latents, generators, prompts, first_step=first)
        state.control_images = controls
        return state


def start_at_strength(family: TaskFamily, request: GenerationRequest, scheduler: Any) -> int:
    """Set the request's own scheduler to begin where its strength says; the index of its
    first timestep (`get_timesteps`)."""
    params = request.params
    skipped = family.skipped_steps(resolved(params.num_inference_steps), resolved(params.strength))
    first = skipped * int(scheduler.order)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(first)
    return first


IMAGE_TO_IMAGE = ImageToImage()
