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

from engine.request import BatchKey, GenerationRequest, InvalidRequestError
from pipelines.request_setup import Conditioning, Encoded, encode_together, generators_for, own_scheduler
from pipelines.stepping import DenoiseState, SteppedStages
from pipelines.text_to_image import DiffusersTextToImage, resolved


class StableDiffusionTextToImage(SteppedStages, DiffusersTextToImage):
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
            embeds, _ = self.pipe.encode_prompt(texts, self.pipe._execution_device, 1, False)
            return (embeds,)

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return {"encoder_hidden_states": rows[0]}

        return encode_together(requests, self._uses_cfg, encode, conditioning)

    def _prepare(
        self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None
    ) -> DenoiseState:
        pipe, params = self.pipe, request.params
        if pipe.unet.config.time_cond_proj_dim is not None:
            # LCM-distilled UNets take a guidance embedding these stages do not compute yet.
            raise InvalidRequestError(
                "this model's UNet is guidance-distilled (LCM), which step-level batching does not "
                "serve yet: start the server with --batching request"
            )
        device = pipe._execution_device
        generators = generators_for(request)
        scheduler = own_scheduler(pipe.scheduler, resolved(params.num_inference_steps), device)
        scale = pipe.vae_scale_factor
        shape = (
            params.n,
            pipe.unet.config.in_channels,
            resolved(params.height) // scale,
            resolved(params.width) // scale,
        )
        dtype = cond["encoder_hidden_states"].dtype
        latents = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
        return DenoiseState.start(
            request,
            scheduler,
            latents * scheduler.init_noise_sigma,
            prompts=(cond, uncond),
            guidance_scale=resolved(params.guidance_scale),
            generators=generators,
            step_kwargs=pipe.prepare_extra_step_kwargs(generators, 0.0),
        )

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        out: torch.Tensor = self.pipe.unet(latents, timesteps, **cond, return_dict=False)[0]
        return out
