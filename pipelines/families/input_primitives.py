"""What the tasks that bring input media (an input image, a mask, references, a control
video) ask of a family: the primitives each such task composes its stages from.

Only the families that declare those tasks write them; the defaults refuse, naming the family.
They are many and read only by `pipelines.tasks`, so they live apart from the text-to-X
contract; `pipelines.families.base.Family` inherits them, and every family reads them there.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.stepping.setup import flow_skipped_steps
from pipelines.stepping.state import Encoded


class InputPrimitives:
    """The defaults: no input image, no mask, no references, no control video; noising and
    skipped steps as flow matching or Stable Diffusion's pipelines do them."""

    # Declared by `Family`: how `noised` and `skipped_steps` count.
    flow_matching: ClassVar[bool]

    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor:
        """The input's VAE latents (unpacked), sampled with the request's generators; the
        caller holds `vae_lock`."""
        raise NotImplementedError(f"{type(self).__name__} takes no input image")

    def noise_shape(self, request: GenerationRequest) -> tuple[int, ...]:
        """The shape of an inpainting request's noise (unpacked)."""
        raise NotImplementedError(f"{type(self).__name__} does not inpaint")

    def noised(
        self, scheduler: Any, image: Tensor, noise: Tensor, first: int, *, full: bool = False
    ) -> Tensor:
        """`image` noised to the request's timestep `first` (unpacked): flow matching mixes
        the two (`scale_noise`); otherwise `add_noise`, or with `full` the noise alone at the
        scheduler's initial sigma (strength 1, as the inpainting pipelines start)."""
        at = scheduler.timesteps[first : first + 1].repeat(image.shape[0])
        if self.flow_matching:
            mixed: Tensor = scheduler.scale_noise(image, at, noise)
            return mixed
        if full:
            scaled: Tensor = noise * scheduler.init_noise_sigma
            return scaled
        added: Tensor = scheduler.add_noise(image, noise, at)
        return added

    def pack(self, latents: Tensor, request: GenerationRequest) -> Tensor:
        """Latents as the denoiser takes them (2x2 patches as tokens for FLUX, Qwen-Image)."""
        return latents

    def skipped_steps(self, steps: int, strength: float) -> int:
        """How many of its steps an image-to-image request skips, as the family's diffusers
        `get_timesteps` counts them: the flow-matching pipelines round the skipped steps
        down, Stable Diffusion's the redrawn steps."""
        if self.flow_matching:
            return flow_skipped_steps(steps, strength)
        return max(steps - min(int(steps * strength), steps), 0)

    def reads_mask(self) -> bool:
        """Whether the denoiser takes the mask and the masked image as inputs."""
        return False

    def reference_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """A reference edit's start latents, its input image's latents put into both
        conditionings."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def reference_sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]:
        """(width, height) of each of the request's references as the pipeline sizes them."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference images")

    def check_references(self, request: GenerationRequest) -> None:
        """Raise `InvalidRequestError` (naming `image`) for references the pipeline refuses."""

    def reference_call_kwargs(self) -> dict[str, Any]:
        """Other arguments of a request-level call with references."""
        return {}

    def add_references(self, request: GenerationRequest, prompts: Encoded) -> None:
        """Put the request's reference tokens (and their position ids) into both
        conditionings, one row per image."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference images")

    def reference_output_size(self, request: GenerationRequest) -> tuple[int, int]:
        """A multi-reference edit's (width, height) when it sets none, from its images."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference images")

    def reduce_references(self, request: GenerationRequest) -> GenerationRequest:
        """The request with its references reduced as the pipeline first reduces them, so a
        large upload does not wait in the queue at full size; the request itself where the
        pipeline uses them as sent."""
        return request

    def image_to_video_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """An image-to-video request's start latents, its image's conditioning put into both
        conditionings."""
        raise NotImplementedError(f"{type(self).__name__} makes no video from an image")

    def control_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """A controlled video's start latents (its references' frames included), its control
        latents put into both conditionings."""
        raise NotImplementedError(f"{type(self).__name__} takes no control video")

    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        """The mask at latent size, packed as the latents (1 = repaint), and the masked
        image's latents where the denoiser reads them."""
        raise NotImplementedError(f"{type(self).__name__} does not inpaint")
