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

Reference images (`pipelines.tasks.references`, on both image endpoints; prepared as the call
prepares them in `pipelines.families.qwen_image_21_references`): up to three per request,
each resized to the area of `output_resolution` squared (its aspect kept, sides rounded to
32; `--reference-resolution`, the call's 1024 by default). Qwen3-VL reads them
beside the prompt (a picture slot per image before the text, the text encoder's copy
flattened over white), and their VAE latents (RGBA, the mode: nothing drawn) go BEFORE the
noise in the transformer's sequence, filling the text's picture slots, block-causal. A
request's negative prompt is read with its images too. Rows of one forward share their
references' sizes (the step key), so with the text length their picture slots line up.
The output size defaults to the last reference's, as in the call. diffusers takes one set of
references for every prompt of a call: request-level it is one request per call anyway.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.cache.calls import denoiser_call
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import TRUE_CFG, Guidance, Sizes
from pipelines.families.qwen_image_21_references import MAX_REFERENCES, References
from pipelines.family_options import call_default
from pipelines.outputs import resolved
from pipelines.qwen_edit_loading import load_qwen_image_21
from pipelines.stepping.setup import encode_together, flow_scheduler
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.references import REFERENCE_LATENTS, REFERENCES

_TEXT = "encoder_hidden_states"
_MASK = "encoder_hidden_states_mask"
# Which text positions are a reference's picture slots (the encoder's `image_pad_mask`).
_SLOTS = "image_pad_mask"
_TEXT_NAMES = (_TEXT, _MASK, _SLOTS)
# QwenImage21Pipeline's constants: 16x latents (not read from the VAE), and one vision slot
# of the joint sequence per 2x2 latent tokens.
_SCALE = 16
_TOKENS_PER_SLOT = 4


class QwenImage21(Family):
    """Qwen-Image 2.1: 40 steps, true CFG off by default (scale 1), 1024x1024 by default."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        # diffusers' call pads prompts to one length, which changes the images: one request
        # per call (its n images share one prompt, so they may share it).
        TaskUse(
            REFERENCES,
            "QwenImage21Pipeline",
            name="QwenImage21TextToImage",
            images=(0, MAX_REFERENCES),
            request_batch=False,
            loader=load_qwen_image_21,
        ),
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

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        return (self.pipe.transformer,)  # step mode only: diffusers' hooks lack its blocks

    def first_block_steps(self) -> bool:
        return True

    def steps(self) -> bool:
        return True

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            # Texts without references in one call; a request's with its references in one
            # call of their own (the call gives every text of it the same pictures).
            groups: dict[str, list[int]] = {}
            for row, owner in enumerate(owners):
                groups.setdefault(owner.request_id if owner.input_images else "", []).append(row)
            encoded: list[tuple[Tensor, ...]] = [()] * len(texts)
            for rows in groups.values():
                owner = owners[rows[0]]
                pictures = self._references().encoder_pictures(owner) if owner.input_images else None
                embeds, mask, slots = self.pipe.encode_prompt(
                    [texts[row] for row in rows], image=pictures, device=self.device
                )
                if mask is None:  # diffusers drops a mask that is all ones
                    mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
                for i, row in enumerate(rows):
                    encoded[row] = (embeds[i], mask[i], slots[i])
            return tuple(_stacked([row[name] for row in encoded]) for name in range(3))

        return encode_together(requests, self.uses_cfg, encode, lambda r, rows: self._conditioning(*rows))

    @staticmethod
    def _conditioning(embeds: Tensor, mask: Tensor, slots: Tensor) -> Conditioning:
        length = int(mask.sum(dim=1).max())  # this request's own text, without the batch's padding
        return {_TEXT: embeds[:, :length], _MASK: mask[:, :length], _SLOTS: slots[:, :length]}

    # References (`qwen_image_21_references`) ----------------------------------------------

    def _resolution(self) -> int:
        resolution = self.config.options.reference_resolution
        return int(call_default(self.pipe, "output_resolution") if resolution is None else resolution)

    def _references(self) -> References:
        # Built per call: the resolution is read live from the config.
        return References(self.pipe, self._resolution())

    def reference_sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]:
        return self._references().sizes(request)

    def reference_output_size(self, request: GenerationRequest) -> tuple[int, int]:
        # The call's default: the LAST image's aspect ratio at the same area, as its reference.
        return self.reference_sizes(request)[-1]

    def reduce_references(self, request: GenerationRequest) -> GenerationRequest:
        return self._references().reduced(request)

    def check_references(self, request: GenerationRequest) -> None:
        # Both sides at least one vision slot (2x2 latent tokens) wide.
        self._references().check(request, minimum_side=_SCALE * 2)

    def reference_call_kwargs(self) -> dict[str, Any]:
        return {"output_resolution": self._resolution()}

    def add_references(self, request: GenerationRequest, prompts: Encoded) -> None:
        """The references' packed VAE latents, in reference order, n rows each, into both
        conditionings."""
        dtype = prompts[0][_TEXT].dtype
        with self.vae_lock:  # a decode may be running beside
            references = self._references().latents(request, self.device, dtype)
        for conditioning in prompts:
            if conditioning is not None:
                conditioning[REFERENCE_LATENTS] = references

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
        """Every request's text padded to the longest; `denoise` trims each row back.
        References are of one layout in a step (the step key): they concatenate as they are."""
        longest = max(cond[_TEXT].shape[1] for cond in conds)

        def padded(tensor: Tensor) -> Tensor:
            pad = tensor.new_zeros((tensor.shape[0], longest - tensor.shape[1], *tensor.shape[2:]))
            return torch.cat([tensor, pad], dim=1)

        merged = {name: torch.cat([padded(c[name]) for c in conds]) for name in _TEXT_NAMES}
        if REFERENCE_LATENTS in conds[0]:
            merged[REFERENCE_LATENTS] = torch.cat([c[REFERENCE_LATENTS] for c in conds])
        return merged

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """One transformer forward per text length among the rows (see the module's note),
        each row's text unpadded, as the stock call runs a request alone; a row's references
        before its noise, filling its text's picture slots (the same positions in every row
        of one length: the references' sizes are in the step key)."""
        request = states[0].request
        params = request.params
        shapes = [(1, height // _SCALE, width // _SCALE) for width, height in self.reference_sizes(request)]
        shapes.append((1, resolved(params.height) // _SCALE, resolved(params.width) // _SCALE))
        tokens = latents.shape[1]
        lengths = cond[_MASK].sum(dim=1).tolist()  # one host sync per step, before any forward
        out = torch.empty_like(latents)
        for length in sorted(set(lengths)):
            own = [i for i, each in enumerate(lengths) if each == length]
            rows = torch.tensor(own, device=latents.device)
            hidden = latents[rows]
            if REFERENCE_LATENTS in cond:
                hidden = torch.cat([cond[REFERENCE_LATENTS][rows], hidden], dim=1)
            # The text's picture slots, then the target image's, which follow the text.
            text_slots = cond[_SLOTS][rows, :length].bool()
            target_slots = text_slots.new_ones((len(rows), tokens // _TOKENS_PER_SLOT))
            slots = torch.cat([text_slots, target_slots], dim=1)
            with denoiser_call(own, tokens=length):  # First-Block Cache: residuals per length
                predicted: Tensor = self.pipe.transformer(
                    hidden_states=hidden,
                    timestep=timesteps[rows].to(latents.dtype) / 1000,
                    encoder_hidden_states=cond[_TEXT][rows, :length],
                    encoder_hidden_states_mask=None,
                    img_shapes=[shapes] * len(rows),
                    img_mask=slots,
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


def _stacked(rows: list[Tensor]) -> Tensor:
    """Rows of different lengths, zero-padded at the end to the longest, stacked."""
    longest = max(row.shape[0] for row in rows)
    padded = [torch.cat([row, row.new_zeros((longest - row.shape[0], *row.shape[1:]))]) for row in rows]
    return torch.stack(padded)
