"""Qwen-Image: its request-level adapter (defaults, true CFG, size rules) and its own
denoising loop in stages for step-level batching, following `QwenImagePipeline.__call__`:
the prompt through the chat template and Qwen2.5-VL, packed latents from each request's
generators, a flow-matching schedule of its own (sigmas 1 → 1/steps, shifted by `mu` from
the image's token count), the transformer with a per-row timestep / 1000, and true CFG
with the per-row norm rescale, for requests that have a negative prompt and a true CFG
scale above 1.

Prompts differ in length: a step pads every request's text to the group's longest with a
zero mask, which the transformer honours, so rows of any prompt length share a forward.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import BatchKey, GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.families.policies import PATCHIFIED, TRUE_CFG, Guidance, Sizes
from pipelines.outputs import resolved
from pipelines.stepping.setup import PackedFlowMatching, encode_together, generators_for, guidance_rows
from pipelines.stepping.stages import SteppedStages
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.text_to_image import DiffusersTextToImage

_TEXT = "encoder_hidden_states"
_MASK = "encoder_hidden_states_mask"
# QwenImagePipeline.__call__'s default.
_MAX_SEQUENCE_LENGTH = 512


class QwenImageTextToImage(PackedFlowMatching, SteppedStages, DiffusersTextToImage):
    """Qwen-Image: true CFG scale 4 by default, applied when a request has a negative prompt;
    `guidance_scale` matters only for guidance-distilled checkpoints."""

    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = None
    default_true_cfg_scale: ClassVar[float | None] = 4.0
    guidance: ClassVar[Guidance] = TRUE_CFG
    sizes: ClassVar[Sizes] = PATCHIFIED

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        # One step gives sigma 1.0 with Qwen-Image's terminal shift: 0/0 in diffusers, NaN images.
        if resolved(params.num_inference_steps) < 2:
            raise InvalidRequestError(
                "num_inference_steps must be at least 2 for Qwen-Image", "num_inference_steps"
            )

    def step_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        return ("qwen-image", params.width, params.height, params.output_type, params.lora)

    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        return encode_together(
            requests, self._uses_cfg, self._encode_texts, lambda r, rows: self._conditioning(r, *rows)
        )

    def _encode_texts(self, texts: list[str], owners: list[GenerationRequest]) -> tuple[Tensor, Tensor]:
        """Prompt embeddings and their mask, one row per text."""
        embeds, mask = self.pipe.encode_prompt(
            texts,
            device=self.device,
            max_sequence_length=_MAX_SEQUENCE_LENGTH,
            **self._prompt_inputs(owners),
        )
        if mask is None:  # diffusers drops a mask that is all ones
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    def _prompt_inputs(self, owners: list[GenerationRequest]) -> dict[str, Any]:
        """What the text encoder reads besides the texts (an edit: each text's image)."""
        return {}

    def _conditioning(self, request: GenerationRequest, embeds: Tensor, mask: Tensor) -> Conditioning:
        length = int(mask.sum(dim=1).max())  # this request's own text, without the batch's padding
        cond = {_TEXT: embeds[:, :length], _MASK: mask[:, :length]}
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = guidance_rows(embeds, resolved(request.params.guidance_scale))
        return cond

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        generators = generators_for(request)
        latents = self._initial_latents(request, generators, cond, uncond)
        return self._state(request, self._own_scheduler(request), latents, generators, (cond, uncond))

    # A hook of `_prepare` beside `PackedFlowMatching`'s, which the edits override ----------

    def _initial_latents(
        self,
        request: GenerationRequest,
        generators: list[torch.Generator],
        cond: Conditioning,
        uncond: Conditioning | None,
    ) -> Tensor:
        """The request's packed noise, from its own generators."""
        pipe, params = self.pipe, request.params
        latents: Tensor = pipe.prepare_latents(
            params.n,
            pipe.transformer.config.in_channels // 4,
            resolved(params.height),
            resolved(params.width),
            cond[_TEXT].dtype,
            self.device,
            generators,
        )
        return latents

    def _merge(self, conds: list[Conditioning]) -> Conditioning:
        """Pad every request's text to the longest in the group; the mask hides the padding."""
        longest = max(cond[_TEXT].shape[1] for cond in conds)

        def padded(tensor: Tensor) -> Tensor:
            missing = longest - tensor.shape[1]
            if missing == 0:
                return tensor
            pad = tensor.new_zeros((tensor.shape[0], missing, *tensor.shape[2:]))
            return torch.cat([tensor, pad], dim=1)

        text = (_TEXT, _MASK)
        return {
            name: torch.cat([padded(c[name]) if name in text else c[name] for c in conds])
            for name in conds[0]
        }

    def _guide(self, uncond: Tensor, cond: Tensor, scale: float) -> Tensor:
        combined = uncond + scale * (cond - uncond)
        # Qwen-Image keeps each token's norm of the conditional prediction.
        kept: Tensor = torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
        return combined * kept

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        out: Tensor = self.pipe.transformer(
            hidden_states=latents,
            timestep=timesteps.to(latents.dtype) / 1000,
            guidance=cond.get("guidance"),
            encoder_hidden_states_mask=cond[_MASK],
            encoder_hidden_states=cond[_TEXT],
            img_shapes=[self._image_shapes(states[0].request)] * latents.shape[0],
            return_dict=False,
        )[0]
        return out

    def _image_shapes(self, request: GenerationRequest) -> list[tuple[int, int, int]]:
        """(frames, rows, columns) of each image the transformer sees, in tokens."""
        side = self.pipe.vae_scale_factor * 2
        return [(1, resolved(request.params.height) // side, resolved(request.params.width) // side)]

    def _latent_grid(self, states: list[Any], latents: Tensor) -> Tensor:
        """(B, C, h, w): the packed tokens unpacked, without the VAE's frame axis."""
        params = states[0].request.params
        unpacked: Tensor = self.pipe._unpack_latents(
            latents, resolved(params.height), resolved(params.width), self.pipe.vae_scale_factor
        )
        return unpacked[:, :, 0]

    def _decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        latents = self._latent_grid(states, latents)[:, :, None].to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="np")
