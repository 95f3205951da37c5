"""Stable Diffusion 1.x/2.x: request-level batching from the base adapter, and its own
denoising loop in stages (prepare, step, finish) for step-level batching.

The stages follow `StableDiffusionPipeline.__call__` step by step — encode the prompt,
set the timesteps (on the request's own scheduler copy), draw the latents from the
request's generators scaled by that copy's `init_noise_sigma`, denoise, decode and run
the safety checker — so a request's image equals the stock pipeline's for it alone.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import BatchKey, GenerationRequest
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, generators_for, own_scheduler
from pipelines.stepping.stages import SteppedStages
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.text_to_image import DiffusersTextToImage


class StableDiffusionTextToImage(SteppedStages, DiffusersTextToImage):
    @property
    def supports_step_batch(self) -> bool:  # type: ignore[override]
        # LCM-distilled UNets take a guidance embedding these stages do not compute yet:
        # such a checkpoint is served request-level (said once in the log).
        return self.pipe.unet.config.time_cond_proj_dim is None

    def step_key(self, request: GenerationRequest) -> BatchKey:
        # Steps, guidance and the negative prompt are per request: only the latent shape
        # (and what changes the weights) must be shared by one denoiser forward.
        params = request.params
        return ("sd", params.width, params.height, params.output_type, params.lora)

    # Family hooks: what SDXL changes ----------------------------------------------------

    def _decode(self, states: list[Any], latents: Tensor) -> Any:
        """As the stock pipeline's tail: VAE, safety checker, postprocess."""
        pipe = self.pipe
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        image, nsfw = pipe.run_safety_checker(image, latents.device, latents.dtype)
        denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
        return pipe.image_processor.postprocess(image, output_type="np", do_denormalize=denormalize)

    def _uses_cfg(self, request: GenerationRequest) -> bool:
        # As in diffusers: guidance above 1, and not a guidance-distilled UNet (LCM).
        distilled = self.pipe.unet.config.time_cond_proj_dim is not None
        return resolved(request.params.guidance_scale) > 1 and not distilled

    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        """CLIP pads to a fixed length, so every joiner's rows come from one encoder call."""

        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, _ = self.pipe.encode_prompt(texts, self.device, 1, False)
            return (embeds,)

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return {"encoder_hidden_states": rows[0]}

        return encode_together(requests, self._uses_cfg, encode, conditioning)

    def _prepare(
        self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None
    ) -> DenoiseState:
        pipe, params = self.pipe, request.params
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        scale = pipe.vae_scale_factor
        shape = (
            params.n,
            pipe.unet.config.in_channels,
            resolved(params.height) // scale,
            resolved(params.width) // scale,
        )
        dtype = cond["encoder_hidden_states"].dtype
        noise = randn_tensor(shape, generator=generators, device=self.device, dtype=dtype)
        latents = noise * scheduler.init_noise_sigma
        return self._state(request, scheduler, latents, generators, (cond, uncond))

    # Hooks of `_prepare`, which image-to-image and inpainting (pipelines/image_to_image.py,
    # pipelines/inpainting.py) use with latents of their own ------------------------------

    def _own_scheduler(self, request: GenerationRequest) -> Any:
        """A copy of the pipeline's scheduler with the request's timesteps set."""
        steps = resolved(request.params.num_inference_steps)
        return own_scheduler(self.pipe.scheduler, steps, self.device)

    def _state(
        self,
        request: GenerationRequest,
        scheduler: Any,
        latents: Tensor,
        generators: list[torch.Generator],
        prompts: Encoded,
        *,
        first_step: int = 0,
    ) -> DenoiseState:
        """The request at its first step: SD's guidance and scheduler step arguments."""
        return DenoiseState.start(
            request,
            scheduler,
            latents,
            prompts=prompts,
            guidance_scale=resolved(request.params.guidance_scale),
            generators=generators,
            step_kwargs=self.pipe.prepare_extra_step_kwargs(generators, 0.0),
            first_step=first_step,
        )

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        out: torch.Tensor = self.pipe.unet(latents, timesteps, **cond, return_dict=False)[0]
        return out
