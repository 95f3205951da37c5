"""Stable Diffusion 3 / 3.5: its request-level adapter and its own denoising loop in stages
for step-level batching, following `StableDiffusion3Pipeline.__call__`: two CLIP and one
T5 encoders (CLIP padded to 77 tokens and T5 to `max_sequence_length`, so every prompt has
the same length and rows concatenate), latents from each request's generators, a
flow-matching schedule of its own (shifted by `mu` where the scheduler uses dynamic
shifting), the MMDiT with a per-row timestep, and classifier-free guidance above 1.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import BatchKey, GenerationRequest
from pipelines.families import TransformerTextToImage
from pipelines.stepping import Conditioning, DenoiseState, Encoded, SteppedStages, own_scheduler
from pipelines.text_to_image import resolved

# StableDiffusion3Pipeline.__call__'s default: T5 pads every prompt to this many tokens.
_MAX_SEQUENCE_LENGTH = 256


class StableDiffusion3TextToImage(SteppedStages, TransformerTextToImage):
    default_steps: ClassVar[int] = 28
    default_guidance_scale: ClassVar[float | None] = 7.0

    def model_size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor) * int(self.pipe.patch_size)

    def step_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        return ("sd3", params.width, params.height, params.output_type, params.lora)

    def _uses_cfg(self, request: GenerationRequest) -> bool:
        return resolved(request.params.guidance_scale) > 1

    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        """All joiners' prompts and, for those with guidance, negative prompts ("" when none,
        as SD3 does), in one call per encoder."""
        guided = [r for r in requests if self._uses_cfg(r)]
        texts = [r.prompt for r in requests for _ in range(r.params.n)]
        texts += [r.params.negative_prompt or "" for r in guided for _ in range(r.params.n)]
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=texts,
            prompt_2=None,
            prompt_3=None,
            device=self.pipe._execution_device,
            do_classifier_free_guidance=False,
            max_sequence_length=_MAX_SEQUENCE_LENGTH,
        )
        sizes = [r.params.n for r in [*requests, *guided]]
        rows = iter(zip(embeds.split(sizes), pooled.split(sizes), strict=True))

        def conditioning(text: Tensor, pooled_rows: Tensor) -> Conditioning:
            return {"encoder_hidden_states": text, "pooled_projections": pooled_rows}

        positive = [conditioning(*next(rows)) for _ in requests]
        guided_ids = {r.request_id for r in guided}
        return [
            (cond, conditioning(*next(rows)) if r.request_id in guided_ids else None)
            for r, cond in zip(requests, positive, strict=True)
        ]

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        pipe, params = self.pipe, request.params
        device = pipe._execution_device
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in params.image_seeds()]
        scale = pipe.vae_scale_factor
        height, width = resolved(params.height) // scale, resolved(params.width) // scale
        shape = (params.n, pipe.transformer.config.in_channels, height, width)
        dtype = cond["encoder_hidden_states"].dtype
        latents = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
        config = pipe.scheduler.config
        kwargs: dict[str, Any] = {}
        if config.get("use_dynamic_shifting", None):
            patch = pipe.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (height // patch) * (width // patch),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        scheduler = own_scheduler(pipe.scheduler, resolved(params.num_inference_steps), device, **kwargs)
        return DenoiseState(
            request=request,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            latents=latents,
            cond=cond,
            uncond=uncond,
            guidance_scale=resolved(params.guidance_scale),
            generators=generators,
        )

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        out: Tensor = self.pipe.transformer(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            return_dict=False,
        )[0]
        return out

    def _decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe = self.pipe
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")
