"""Stable Diffusion 1.x/2.x: request-level batching from the base adapter, and its own
denoising loop in stages (prepare, step, finish) for step-level batching.

The stages follow `StableDiffusionPipeline.__call__` step by step — encode the prompt,
set the timesteps (on the request's own scheduler copy), draw the latents from the
request's generators scaled by that copy's `init_noise_sigma`, denoise, decode and run
the safety checker — so a request's image equals the stock pipeline's for it alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.utils.torch_utils import randn_tensor

from engine.request import BatchKey, GenerationRequest, RequestOutput
from pipelines.stepping import DenoiseState, own_scheduler, step_together
from pipelines.text_to_image import DiffusersTextToImage, resolved, to_arrays


class StableDiffusionTextToImage(DiffusersTextToImage):
    supports_step_batch: ClassVar[bool] = True

    def step_key(self, request: GenerationRequest) -> BatchKey:
        # Steps, guidance and the negative prompt are per request: only the latent shape
        # (and what changes the weights) must be shared by one denoiser forward.
        params = request.params
        return ("sd", params.width, params.height, params.output_type, params.lora)

    def prepare(self, requests: list[GenerationRequest]) -> list[DenoiseState]:
        with torch.inference_mode():
            return [self._prepare(request) for request in requests]

    def step(self, states: list[Any]) -> None:
        with torch.inference_mode():
            step_together(states, self._denoise)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        pipe = self.pipe
        latents = torch.cat([state.latents for state in states])
        if states[0].request.params.output_type == "latent":
            arrays = to_arrays(latents, "latent")
        else:
            with torch.inference_mode():
                image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
                image, nsfw = pipe.run_safety_checker(image, latents.device, latents.dtype)
            denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
            arrays = to_arrays(
                pipe.image_processor.postprocess(image, output_type="np", do_denormalize=denormalize), "np"
            )
        outputs, start = [], 0
        for state in states:
            params = state.request.params
            outputs.append(
                RequestOutput(
                    request_id=state.request.request_id,
                    images=tuple(arrays[start : start + params.n]),
                    seeds=tuple(params.image_seeds()),
                )
            )
            start += params.n
        return outputs

    def _prepare(self, request: GenerationRequest) -> DenoiseState:
        pipe, params = self.pipe, request.params
        device = pipe._execution_device
        guidance = resolved(params.guidance_scale)
        use_cfg = guidance > 1 and pipe.unet.config.time_cond_proj_dim is None
        cond, uncond = pipe.encode_prompt(request.prompt, device, params.n, use_cfg, params.negative_prompt)
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in params.image_seeds()]
        scheduler = own_scheduler(pipe.scheduler, resolved(params.num_inference_steps), device)
        scale = pipe.vae_scale_factor
        shape = (
            params.n,
            pipe.unet.config.in_channels,
            resolved(params.height) // scale,
            resolved(params.width) // scale,
        )
        latents = randn_tensor(shape, generator=generators, device=device, dtype=cond.dtype)
        return DenoiseState(
            request=request,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            latents=latents * scheduler.init_noise_sigma,
            cond={"encoder_hidden_states": cond},
            uncond={"encoder_hidden_states": uncond} if use_cfg else None,
            guidance_scale=guidance,
            generators=generators,
            step_kwargs=pipe.prepare_extra_step_kwargs(generators, 0.0),
        )

    def _denoise(
        self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        out: torch.Tensor = self.pipe.unet(latents, timesteps, **cond, return_dict=False)[0]
        return out
