"""Qwen-Image 2.1 (`QwenImage21Pipeline`): text-to-image, request-level and step-level.

The stages follow `QwenImage21Pipeline.__call__`: the prompt through Qwen3-VL (left padding,
the last layer before its final norm, the system prefix dropped), unpatched latents of a 16x
VAE (one token per 16x16 pixels), each request's own flow-matching schedule (the model's
`sample_sigmas` for their step count, else 1 → 1/steps, shifted by `mu` from its token count),
true CFG without a rescale for requests with a negative prompt and `true_cfg_scale` above 1,
and a VAE whose images are RGBA (four channels).

Its transformer runs one sequence of text then image tokens, with rotary positions taken
from the first row's layout: a text token's position is its place in the sequence, on the
height and width axes too, so padding a prompt moves the image relative to the text and
changes the image (measured: 0.03 on the tiny model, either side). Rows therefore share a
forward only with rows of the same text length: a step runs one forward per length (a
request's negative rows usually take their own), and diffusers' own call, which pads, runs
one request at a time. With every row's text its own length, step 0's key/value cache
(`use_kv_cache`, for rows that start together) is not used: the stock image is the same
without it.

Reference images (image-conditioned generation, refs before the noise in the sequence) are
not served yet.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import TRUE_CFG, Guidance, Sizes
from pipelines.outputs import resolved
from pipelines.qwen_edit_loading import load_qwen_image_21
from pipelines.stepping.setup import encode_together, flow_scheduler
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task

_TEXT = "encoder_hidden_states"
_MASK = "encoder_hidden_states_mask"
# QwenImage21Pipeline's constants: 16x latents (not read from the VAE), and one vision slot
# of the joint sequence per 2x2 latent tokens.
_SCALE = 16
_TOKENS_PER_SLOT = 4


class QwenImage21(Family):
    """Qwen-Image 2.1: 40 steps, true CFG off by default (scale 1), 1024x1024 by default."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        # diffusers' call pads prompts to one length, which changes the images: one request
        # per call (its n images share one prompt, so they may share it).
        TaskUse(TEXT_TO_IMAGE, "QwenImage21Pipeline", request_batch=False, loader=load_qwen_image_21),
    )
    key_name: ClassVar[str] = "qwen-image-21"
    default_steps: ClassVar[int] = 40
    default_guidance_scale: ClassVar[float | None] = None
    default_true_cfg_scale: ClassVar[float | None] = 1.0
    guidance: ClassVar[Guidance] = TRUE_CFG
    # Sizes are floored to multiples of 32 by the pipeline (2x2 latent tokens per vision slot).
    sizes: ClassVar[Sizes] = Sizes(default=lambda pipe: (1024, 1024), multiple=lambda pipe: 2 * _SCALE)
    flow_matching: ClassVar[bool] = True

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        # No `guidance_scale` argument; true CFG is off without a negative prompt (in the key).
        kwargs: dict[str, Any] = {"true_cfg_scale": params.true_cfg_scale if params.negative_prompt else 1.0}
        if self._sample_sigmas(params) is None and self.pipe.config.get("sample_sigmas", None) is not None:
            # diffusers would take the model's own grid whatever the step count: ask for the steps.
            steps = resolved(params.num_inference_steps)
            kwargs["sigmas"] = np.linspace(1.0, 1 / steps, steps).tolist()
        return kwargs

    def _sample_sigmas(self, params: SamplingParams) -> list[float] | None:
        """The model's own sigmas (`sample_sigmas` in its model index) where a request asks
        for as many steps as they have, else None: 1 → 1/steps."""
        sigmas = self.pipe.config.get("sample_sigmas", None)
        if sigmas is None or len(sigmas) != resolved(params.num_inference_steps):
            return None
        return list(sigmas)

    def steps(self) -> bool:
        return True

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, mask, _ = self.pipe.encode_prompt(texts, device=self.device)
            if mask is None:  # diffusers drops a mask that is all ones
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            return embeds, mask

        return encode_together(requests, self.uses_cfg, encode, lambda r, rows: self._conditioning(*rows))

    @staticmethod
    def _conditioning(embeds: Tensor, mask: Tensor) -> Conditioning:
        length = int(mask.sum(dim=1).max())  # this request's own text, without the batch's padding
        return {_TEXT: embeds[:, :length], _MASK: mask[:, :length]}

    def scheduler(self, request: GenerationRequest) -> Any:
        steps = resolved(request.params.num_inference_steps)
        sigmas = self._sample_sigmas(request.params)
        return flow_scheduler(self.pipe.scheduler, steps, self._tokens(request), self.device, sigmas=sigmas)

    def _tokens(self, request: GenerationRequest) -> int:
        params = request.params
        return (resolved(params.height) // _SCALE) * (resolved(params.width) // _SCALE)

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        pipe, params = self.pipe, request.params
        latents, _ = pipe.prepare_latents(
            None,
            params.n,
            pipe.transformer.config.in_channels,
            resolved(params.height),
            resolved(params.width),
            cond[_TEXT].dtype,
            self.device,
            generators,
        )
        noise: Tensor = latents
        return noise

    def merge(self, conds: list[Conditioning]) -> Conditioning:
        """Every request's text padded to the longest; `denoise` trims each row back."""
        longest = max(cond[_TEXT].shape[1] for cond in conds)

        def padded(tensor: Tensor) -> Tensor:
            pad = tensor.new_zeros((tensor.shape[0], longest - tensor.shape[1], *tensor.shape[2:]))
            return torch.cat([tensor, pad], dim=1)

        return {name: torch.cat([padded(c[name]) for c in conds]) for name in (_TEXT, _MASK)}

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """One transformer forward per text length among the rows (see the module's note),
        each row's text unpadded, as the stock call runs a request alone."""
        params = states[0].request.params
        shape = (1, resolved(params.height) // _SCALE, resolved(params.width) // _SCALE)
        tokens = latents.shape[1]
        lengths = cond[_MASK].sum(dim=1).tolist()  # one host sync per step, before any forward
        out = torch.empty_like(latents)
        for length in sorted(set(lengths)):
            rows = torch.tensor([i for i, own in enumerate(lengths) if own == length], device=latents.device)
            text = cond[_TEXT][rows, :length]
            slots = torch.zeros((len(rows), length + tokens // _TOKENS_PER_SLOT), dtype=torch.bool)
            slots[:, length:] = True  # the target image's slots follow the text
            predicted: Tensor = self.pipe.transformer(
                hidden_states=latents[rows],
                timestep=timesteps[rows].to(latents.dtype) / 1000,
                encoder_hidden_states=text,
                encoder_hidden_states_mask=None,
                img_shapes=[[shape]] * len(rows),
                img_mask=slots.to(latents.device),
                return_dict=False,
            )[0]
            out[rows] = predicted[:, -tokens:]
        return out

    def latent_grid(self, states: list[Any], latents: Tensor) -> Tensor:
        """(B, C, h, w): the tokens as the latent image."""
        params = states[0].request.params
        unpacked: Tensor = self.pipe._unpack_latents(
            latents, resolved(params.height), resolved(params.width), _SCALE
        )
        return unpacked[:, :, 0]

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        latents = self.latent_grid(states, latents)[:, :, None].to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="np")
