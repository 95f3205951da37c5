"""Stable Diffusion 3 / 3.5: its request-level adapter and its own denoising loop in stages
for step-level batching, following `StableDiffusion3Pipeline.__call__`: two CLIP and one
T5 encoders (CLIP padded to 77 tokens and T5 to `max_sequence_length`, so every prompt has
the same length and rows concatenate), latents from each request's generators, a
flow-matching schedule of its own (shifted by `mu` where the scheduler uses dynamic
shifting), the MMDiT with a per-row timestep, and classifier-free guidance above 1.
"""

from __future__ import annotations

from typing import Any, ClassVar

from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import BatchKey, GenerationRequest
from pipelines.families.policies import PATCHIFIED, Sizes
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, flow_scheduler, generators_for
from pipelines.stepping.stages import SteppedStages
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.text_to_image import DiffusersTextToImage

# StableDiffusion3Pipeline.__call__'s default: T5 pads every prompt to this many tokens.
_MAX_SEQUENCE_LENGTH = 256


class StableDiffusion3TextToImage(SteppedStages, DiffusersTextToImage):
    default_steps: ClassVar[int] = 28
    default_guidance_scale: ClassVar[float | None] = 7.0
    sizes: ClassVar[Sizes] = PATCHIFIED

    def step_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        return ("sd3", params.width, params.height, params.output_type, params.lora)

    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        """All joiners' prompts and, for those with guidance, negative prompts ("" when none,
        as SD3 does), in one call per encoder."""

        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=texts,
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
            )
            return embeds, pooled

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return {"encoder_hidden_states": rows[0], "pooled_projections": rows[1]}

        return encode_together(requests, self._uses_cfg, encode, conditioning)

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        pipe, params = self.pipe, request.params
        device = self.device
        generators = generators_for(request)
        scale = pipe.vae_scale_factor
        height, width = resolved(params.height) // scale, resolved(params.width) // scale
        shape = (params.n, pipe.transformer.config.in_channels, height, width)
        dtype = cond["encoder_hidden_states"].dtype
        latents = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
        patch = pipe.transformer.config.patch_size
        scheduler = flow_scheduler(
            pipe.scheduler,
            resolved(params.num_inference_steps),
            (height // patch) * (width // patch),
            device,
            linear_sigmas=False,  # SD3 lets the scheduler space its own sigmas
            max_shift=1.16,  # SD3's default, where FLUX and Qwen-Image use 1.15
        )
        return DenoiseState.start(
            request,
            scheduler,
            latents,
            prompts=(cond, uncond),
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
