"""Inpainting: a mask says what to repaint, the rest is kept. A family serves it through
diffusers' inpainting pipeline over its weights (`from_pipe`): an inpainting checkpoint
(Stable Diffusion's 9-channel UNet: latents, mask, masked-image latents) or text-to-image
weights.

An output keeps the input's own pixels wherever the mask says keep — in request mode, in
step mode and in previews (`kept`): the VAE cannot reproduce a picture exactly, and only
the masked area should be new. Request-level: one image and mask go to diffusers per
generated image, at strength 1.

Step-level, drawn as the diffusers pipeline draws them (the generators in the same order):
- a denoiser that reads the mask (`TaskFamily.reads_mask`) gets the mask and the masked
  image's latents beside the latents at every step, in the conditioning of each row;
- any other starts from noise and, after every step, gets the input's latents (noised to
  the request's next timestep) back outside the mask (`KeepOutsideMask`).
So requests of any mask, input image, steps and guidance share a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest, RequestBatch
from pipelines.base import Modality
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.family import TaskFamily
from pipelines.tasks.image_input import input_pixels, inputs_at_size, mask_condition, size_of_input


class Inpainting(Task):
    name: ClassVar[str] = "inpainting"
    suffix: ClassVar[str] = "Inpaint"
    modality: ClassVar[Modality] = "edit"
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    accepts_mask: ClassVar[bool] = True
    from_pipe: ClassVar[bool] = True
    needs: ClassVar[tuple[str, ...]] = ("encode_image", "noise_shape", "mask_latents")

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        return size_of_input(family, request)

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        images, masks = [], []
        for request in batch.requests:
            image, mask = inputs_at_size(request)
            for _ in range(request.params.n):
                images.append(Image.fromarray(image))
                masks.append(Image.fromarray(mask))
        # Strength 1: the masked area is drawn anew, not from the input's noised pixels.
        return {"image": images, "mask_image": masks, "strength": 1.0}

    def kept(
        self, family: TaskFamily, request: GenerationRequest, images: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        image, mask = inputs_at_size(request)
        keep = mask[..., None] < 128
        return tuple(np.where(keep, image, generated) for generated in images)

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        """As the inpainting pipelines at strength 1, drawing from the request's generators
        in their order: the input's latents (where they are put back outside the mask),
        noise, then what the family makes of the mask (Stable Diffusion also samples the
        masked input's latents: one row per image, as request mode sends one image per
        generated image)."""
        generators = generators_for(request)
        controls = family.control_images(request, generators)  # before any draw, as diffusers
        scheduler = family.scheduler(request)
        dtype = prompts[0]["encoder_hidden_states"].dtype
        pixels = input_pixels(family, request)
        reads_mask = family.reads_mask()
        image = None
        if not reads_mask or family.samples_input_latents:
            with family.vae_lock:  # a decode may be running beside
                image = family.encode_image(request, pixels, generators, dtype)
        if reads_mask:
            image = None  # drawn only to keep the generators where the pipeline has them
        shape = family.noise_shape(request)
        noise = randn_tensor(shape, generator=generators, device=family.device, dtype=dtype)
        condition = mask_condition(family, request)
        mask, masked_latents = family.mask_latents(request, condition, pixels, generators, dtype)
        start = noise if image is None else image
        latents = family.pack(family.noised(scheduler, start, noise, 0, full=True), request)
        state = family.state(request, scheduler, latents, generators, prompts)
        state.control_images = controls
        if image is None:
            if masked_latents is None:
                raise RuntimeError(f"{type(family).__name__} reads the mask but made no masked-image latents")
            for conditioning in prompts:
                if conditioning is not None:
                    conditioning.update({MASK: mask, MASKED_IMAGE: masked_latents})
        else:
            packed = family.pack(image, request), family.pack(noise, request)
            state.after_step = KeepOutsideMask(*packed, mask, flow_matching=family.flow_matching)
        return state


# The extra denoiser inputs of a family that reads the mask, per row (in the conditioning
# of both guidance halves).
MASK = "mask"
MASKED_IMAGE = "masked_image_latents"


@dataclass(frozen=True, eq=False)
class KeepOutsideMask:
    """An inpainting request's `after_step` where the denoiser does not read the mask:
    outside the mask its latents become the input's, noised to the request's next timestep
    (the input itself after the last step), as the diffusers inpainting pipelines do after
    each scheduler step. Tensors as the latents are, n rows; the mask 1 where repainted."""

    image: Tensor
    noise: Tensor
    mask: Tensor
    # Noised as a flow-matching scheduler does (`scale_noise`), else `add_noise`.
    flow_matching: bool = True

    def __call__(self, state: DenoiseState) -> None:
        kept = self.image
        if not state.is_done:
            # After a step the scheduler's own index points at that timestep.
            upcoming = state.timesteps[state.steps_done].reshape(1)
            if self.flow_matching:
                kept = state.scheduler.scale_noise(kept, upcoming, self.noise)
            else:
                kept = state.scheduler.add_noise(kept, self.noise, upcoming)
        state.latents = (1 - self.mask) * kept + self.mask * state.latents


INPAINTING = Inpainting()
