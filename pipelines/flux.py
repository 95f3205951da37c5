"""FLUX.1: its request-level adapter (defaults, distilled guidance, true CFG) and its own
denoising loop in stages for step-level batching, following `FluxPipeline.__call__`: CLIP
pooled and T5 prompt embeddings (T5 padded to `max_sequence_length`, so every prompt has
the same length and rows concatenate), packed latents from each request's generators, a
flow-matching schedule of its own (sigmas 1 → 1/steps, shifted by `mu` from the image's
token count), the transformer with a per-row timestep / 1000 and — for guidance-distilled
checkpoints such as FLUX.1-dev — a per-row guidance embedding, and true CFG only for
requests with a negative prompt and `true_cfg_scale > 1`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import BatchKey, GenerationRequest
from pipelines.families.policies import PATCHIFIED, TRUE_CFG, Guidance, Sizes
from pipelines.outputs import resolved
from pipelines.stepping.setup import PackedFlowMatching, encode_together, generators_for, guidance_rows
from pipelines.stepping.stages import SteppedStages
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.text_to_image import DiffusersTextToImage

# FluxPipeline.__call__'s default: T5 pads every prompt to this many tokens.
_MAX_SEQUENCE_LENGTH = 512


class FluxTextToImage(PackedFlowMatching, SteppedStages, DiffusersTextToImage):
    """FLUX: `guidance_scale` is the distilled guidance embedding (when the transformer has
    one, as FLUX.1-dev does); true CFG is off by default (`true_cfg_scale` 1)."""

    default_steps: ClassVar[int] = 28
    default_guidance_scale: ClassVar[float | None] = 3.5
    default_true_cfg_scale: ClassVar[float | None] = 1.0
    guidance: ClassVar[Guidance] = TRUE_CFG
    sizes: ClassVar[Sizes] = PATCHIFIED

    def step_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        return ("flux", params.width, params.height, params.output_type, params.lora)

    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=texts,
                prompt_2=None,
                device=self.device,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
            )
            return embeds, pooled

        return encode_together(requests, self._uses_cfg, encode, lambda r, rows: self._conditioning(r, *rows))

    def _conditioning(self, request: GenerationRequest, embeds: Tensor, pooled: Tensor) -> Conditioning:
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = guidance_rows(embeds, resolved(request.params.guidance_scale))
        return cond

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        pipe, params = self.pipe, request.params
        generators = generators_for(request)
        latents, _ = pipe.prepare_latents(
            params.n,
            pipe.transformer.config.in_channels // 4,
            resolved(params.height),
            resolved(params.width),
            cond["encoder_hidden_states"].dtype,
            self.device,
            generators,
        )
        return self._state(request, self._own_scheduler(request), latents, generators, (cond, uncond))

    def _linear_sigmas(self) -> bool:
        # FluxPipeline's sigmas, unless the scheduler asks for its own (`use_flow_sigmas`).
        return not self.pipe.scheduler.config.get("use_flow_sigmas")

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        pipe, params = self.pipe, states[0].request.params
        # Text and image positions are shared by every row: one size per step group, and T5
        # pads every prompt to the same length.
        text = cond["encoder_hidden_states"]
        text_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)
        side = pipe.vae_scale_factor * 2
        height, width = 2 * (resolved(params.height) // side), 2 * (resolved(params.width) // side)
        image_ids = pipe._prepare_latent_image_ids(
            latents.shape[0], height // 2, width // 2, latents.device, latents.dtype
        )
        out: Tensor = pipe.transformer(
            hidden_states=latents,
            timestep=timesteps.to(latents.dtype) / 1000,
            guidance=cond.get("guidance"),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=text,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]
        return out

    def _latent_grid(self, states: list[Any], latents: Tensor) -> Tensor:
        params = states[0].request.params
        grid: Tensor = self.pipe._unpack_latents(
            latents, resolved(params.height), resolved(params.width), self.pipe.vae_scale_factor
        )
        return grid

    def _decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        latents = self._latent_grid(states, latents)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")
