"""FLUX.2 [dev] and [klein]: text-to-image and multi-reference edits (`Flux2Pipeline`,
`Flux2KleinPipeline`), request-level and step-level.

The stages follow `Flux2Pipeline.__call__` (klein's marks its shared methods "Copied from"):
three text-encoder layers side by side, every prompt padded to 512 tokens (so rows and the
klein's negative rows concatenate as they are); noise drawn already patchified and packed
into (HW, 128) tokens with (T=0, h, w, L=0) position ids; a schedule of the request's own
(sigmas 1 → 1/steps, `mu` from its token count AND its step count); the transformer with a
per-row timestep / 1000. References (`pipelines.tasks.references`): each resized to at most
1 MP (already before it queues) and cropped to the size multiple, VAE-encoded (the mode: no
generator draw), batch-norm normalized and packed after the noise, reference i with T = 10 +
10·i.

[dev] embeds a distilled guidance scale (no negative rows); [klein] runs true CFG against an
empty prompt as a second forward in diffusers, here as negative rows of the same forward,
unless the checkpoint is step-distilled (`is_distilled`). Neither call takes a negative
prompt: one is refused.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import CLASSIFIER_FREE, PATCHIFIED, Guidance, Sizes
from pipelines.outputs import resolved
from pipelines.packed_flux2 import packed_forward
from pipelines.stepping.packed_rows import PackedRows
from pipelines.stepping.padded_grid import PaddedGrid, row_grids
from pipelines.stepping.setup import encode_together, flow_scheduler, guidance_rows, packed_size
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.references import REFERENCE_IDS, REFERENCE_LATENTS, REFERENCES

_TEXT = "encoder_hidden_states"
# Both pipelines' defaults: every prompt padded to this many tokens.
_MAX_SEQUENCE_LENGTH = 512
# The pipelines resize a larger reference to this area, keeping its aspect ratio.
_REFERENCE_AREA = 1024 * 1024
# Flux2ImageProcessor.check_image_input's limits, which the stock call raises on.
_MIN_REFERENCE_SIDE = 64
_MAX_ASPECT_RATIO = 8
# References per request. diffusers sets no cap; Black Forest Labs' editing guide
# (docs.bfl.ai/guides/prompting_editing_overview, "Reference Images per Model") gives
# "recommended max 6" for [dev] and "up to 4" for [klein] 4B and 9B.
_DEV_MAX_REFERENCES = 6
_KLEIN_MAX_REFERENCES = 4


class Flux2(Family):
    """FLUX.2 [dev]: `guidance_scale` is the distilled guidance embedding (4 by default)."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(REFERENCES, "Flux2Pipeline", name="Flux2", images=(0, _DEV_MAX_REFERENCES)),
    )
    key_name: ClassVar[str] = "flux2"
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 4.0
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE
    sizes: ClassVar[Sizes] = PATCHIFIED
    flow_matching: ClassVar[bool] = True
    # Requests without references: their rows packed end to end, as FLUX.1's (padded to one
    # grid, `PaddedGrid`, under a cache).
    mixes_sizes: ClassVar[bool] = True
    mixes_sizes_why: ClassVar[str] = (
        "without references: packed end to end, one attention document each "
        "(padded to one grid under a cache)"
    )
    mixing_tasks: ClassVar[tuple[Task, ...]] = (REFERENCES,)  # text-to-image: no images
    splits_tokens: ClassVar[bool] = True
    caches_mixed_sizes: ClassVar[bool] = True  # its rows' places told the cache (`PaddedGrid.own_tokens`)
    packs_sizes: ClassVar[bool] = True  # `pipelines.packed_flux2`, for requests without cache

    def steps(self) -> bool:
        return True

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        # One forward per step with every row; diffusers' hooks do not run on the whole
        # batch (request mode): their tail residual reads the single blocks' joined text and
        # image stream against the head's image stream alone.
        transformer: torch.nn.Module = self.pipe.transformer
        return (transformer,)

    def first_block_steps(self) -> bool:
        return True

    def validate(self, params: SamplingParams) -> None:
        if params.negative_prompt:
            raise InvalidRequestError(
                "negative_prompt is not supported by FLUX.2: describe what to show instead", "negative_prompt"
            )

    def uses_cfg(self, request: GenerationRequest) -> bool:
        return False  # guidance-distilled: one row per image

    def packs_sizes_for(self, task: Task, request: GenerationRequest) -> bool:
        # Reference tokens follow each row's own: such a request keeps one layout per forward.
        return super().packs_sizes_for(task, request) and not request.input_images

    def mixes_sizes_for(self, task: Task, request: GenerationRequest) -> bool:
        # A request's references follow its own tokens: one layout per forward.
        return super().mixes_sizes_for(task, request) and not request.input_images

    def token_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        height, width = packed_size(self.pipe, request)
        return height // 2, width // 2

    def sequence_lengths(self, params: SamplingParams) -> dict[str, int]:
        # The plan cuts `encoder_hidden_states` with `txt_ids` (the text encoder's padded
        # length), `hidden_states` with `img_ids`: one token per 2x2 patch of latents.
        side = self.pipe.vae_scale_factor * 2
        image = (resolved(params.height) // side) * (resolved(params.width) // side)
        return {"text": _MAX_SEQUENCE_LENGTH, "image": image}

    def reference_tokens(self, request: GenerationRequest) -> int:
        side = self.pipe.vae_scale_factor * 2
        return sum((width // side) * (height // side) for width, height in self.reference_sizes(request))

    # References ---------------------------------------------------------------------------

    def reference_sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]:
        return tuple(self._reference_size(image.shape[1], image.shape[0]) for image in request.input_images)

    def _reference_size(self, width: int, height: int) -> tuple[int, int]:
        """As the call sizes a reference: down to `_REFERENCE_AREA` (`_resize_to_target_area`),
        then cropped to the size multiple."""
        if width * height > _REFERENCE_AREA:
            scale = math.sqrt(_REFERENCE_AREA / (width * height))
            width, height = int(width * scale), int(height * scale)
        multiple = self.pipe.vae_scale_factor * 2
        return width // multiple * multiple, height // multiple * multiple

    def reference_output_size(self, request: GenerationRequest) -> tuple[int, int]:
        # The call's default: the first reference's size.
        return self.reference_sizes(request)[0]

    def reduce_references(self, request: GenerationRequest) -> GenerationRequest:
        """Each reference over `_REFERENCE_AREA` resized to it as the call first resizes it
        (`_resize_to_target_area`, Lanczos): the call then takes it as it is, so the image
        is the same as from the upload, and a 4K upload waits in the queue at 1 MP."""
        resize = self.pipe.image_processor._resize_to_target_area
        images = tuple(
            np.asarray(resize(Image.fromarray(image), _REFERENCE_AREA))
            if image.shape[0] * image.shape[1] > _REFERENCE_AREA
            else image
            for image in request.input_images
        )
        if all(new is old for new, old in zip(images, request.input_images, strict=True)):
            return request
        return replace(request, input_images=images, input_digest=None)

    def check_references(self, request: GenerationRequest) -> None:
        for image in request.input_images:
            height, width = image.shape[:2]
            if min(width, height) < _MIN_REFERENCE_SIDE:
                raise InvalidRequestError(
                    f"each image must be at least {_MIN_REFERENCE_SIDE} pixels a side, got {width}x{height}",
                    "image",
                )
            if max(width / height, height / width) > _MAX_ASPECT_RATIO:
                raise InvalidRequestError(
                    f"each image's aspect ratio must be at most {_MAX_ASPECT_RATIO}:1, got {width}x{height}",
                    "image",
                )

    def add_references(self, request: GenerationRequest, prompts: Encoded) -> None:
        """The references as the call prepares them (`prepare_image_latents`), n rows each."""
        pipe, processor = self.pipe, self.pipe.image_processor
        pixels = []
        for image, (width, height) in zip(request.input_images, self.reference_sizes(request), strict=True):
            picture = Image.fromarray(image)
            if picture.width * picture.height > _REFERENCE_AREA:
                picture = processor._resize_to_target_area(picture, _REFERENCE_AREA)
            pixels.append(processor.preprocess(picture, height=height, width=width, resize_mode="crop"))
        with self.vae_lock:  # a decode may be running beside
            latents, ids = pipe.prepare_image_latents(
                images=pixels,
                batch_size=request.params.n,
                generator=None,  # the VAE's mode: nothing drawn
                device=self.device,
                dtype=pipe.vae.dtype,
            )
        for conditioning in prompts:
            if conditioning is not None:
                conditioning.update({REFERENCE_LATENTS: latents, REFERENCE_IDS: ids})

    # Stages -------------------------------------------------------------------------------

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, _ids = self.pipe.encode_prompt(
                prompt=texts, device=self.device, max_sequence_length=_MAX_SEQUENCE_LENGTH
            )
            return (embeds,)

        return encode_together(requests, self.uses_cfg, encode, lambda r, rows: self._conditioning(r, *rows))

    def _conditioning(self, request: GenerationRequest, embeds: Tensor) -> Conditioning:
        cond = {_TEXT: embeds}
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = guidance_rows(embeds, resolved(request.params.guidance_scale))
        return cond

    def scheduler(self, request: GenerationRequest) -> Any:
        # Sigmas 1 → 1/steps unless the scheduler asks for its own (`use_flow_sigmas`); `mu`
        # passed whatever the scheduler's shifting, as the call passes it.
        height, width = packed_size(self.pipe, request)
        tokens = (height // 2) * (width // 2)
        steps = resolved(request.params.num_inference_steps)
        own = bool(self.pipe.scheduler.config.get("use_flow_sigmas"))
        mu = compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
        return flow_scheduler(self.pipe.scheduler, steps, tokens, self.device, linear_sigmas=not own, mu=mu)

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        pipe, params = self.pipe, request.params
        latents, _ids = pipe.prepare_latents(
            batch_size=params.n,
            num_latents_channels=pipe.transformer.config.in_channels // 4,
            height=resolved(params.height),
            width=resolved(params.width),
            dtype=cond[_TEXT].dtype,
            device=self.device,
            generator=generators,
        )
        noise: Tensor = latents
        return noise

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """The transformer over the rows, each followed by its references' tokens; the
        transformer reads row 0's ids, so rows share their layout: one size with references
        (the step key), or rows of different sizes without, laid on one grid (`PaddedGrid`)."""
        pipe = self.pipe
        grids = row_grids(self, states)
        if self.packs_forward(states, grids):
            return self._packed(grids, latents, timesteps, cond)
        grid = PaddedGrid.of(grids, latents.device)
        axes = (torch.arange(1), torch.arange(grid.rows), torch.arange(grid.cols), torch.arange(1))
        ids = torch.cartesian_prod(*axes)
        ids = ids.to(latents.device).unsqueeze(0).expand(latents.shape[0], -1, -1)
        hidden = grid.spread(latents)
        if REFERENCE_LATENTS in cond:
            hidden = torch.cat([latents, cond[REFERENCE_LATENTS]], dim=1)
            ids = torch.cat([ids, cond[REFERENCE_IDS]], dim=1)
        text = cond[_TEXT]
        with grid.own_tokens():
            out: Tensor = pipe.transformer(
                hidden_states=hidden.to(pipe.transformer.dtype),
                timestep=timesteps.to(latents.dtype) / 1000,
                guidance=cond.get("guidance"),
                encoder_hidden_states=text,
                txt_ids=pipe._prepare_text_ids(text).to(latents.device),
                img_ids=ids,
                joint_attention_kwargs=grid.attention_kwargs(text.shape[1]),
                return_dict=False,
            )[0]
        return grid.gather(out, latents.shape[1])

    def _packed(
        self, grids: list[tuple[int, ...]], latents: Tensor, timesteps: Tensor, cond: Conditioning
    ) -> Tensor:
        """The transformer over rows of several sizes packed end to end, one attention
        document each (`pipelines.packed_flux2`): each row's own image positions, no padding."""
        pipe, device = self.pipe, latents.device
        text = cond[_TEXT]
        packed = PackedRows.of(text.shape[1], tuple(height * width for height, width in grids), device)
        image_ids = torch.cat(
            [
                torch.cartesian_prod(
                    torch.arange(1), torch.arange(height), torch.arange(width), torch.arange(1)
                )
                for height, width in packed.in_order(grids)
            ]
        )
        return packed_forward(
            pipe.transformer,
            packed,
            latents,
            timestep=timesteps.to(latents.dtype) / 1000,
            guidance=cond.get("guidance"),
            text=text,
            text_ids=pipe._prepare_text_ids(text[:1])[0].to(device),
            image_ids=image_ids.to(device),
        )

    def latent_grid(self, states: list[Any], latents: Tensor) -> Tensor:
        """(B, 128, h, w): the packed tokens back on their grid (row-major, as their ids say)."""
        height, width = packed_size(self.pipe, states[0].request)
        return latents.transpose(1, 2).reshape(latents.shape[0], latents.shape[2], height // 2, width // 2)

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        grid = self.latent_grid(states, latents)
        # The VAE's batch-norm statistics, which the latents were normalized by.
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(grid.device, grid.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        std = std.to(grid.device, grid.dtype)
        image = vae.decode(pipe._unpatchify_latents(grid * std + mean), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")


class Flux2Klein(Flux2):
    """FLUX.2 [klein]: true CFG against an empty prompt when `guidance_scale` > 1 (4 by
    default), off for a step-distilled checkpoint (`is_distilled`); no guidance embedding."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(REFERENCES, "Flux2KleinPipeline", name="Flux2Klein", images=(0, _KLEIN_MAX_REFERENCES)),
    )
    key_name: ClassVar[str] = "flux2-klein"
    splits_tokens: ClassVar[bool] = True  # FLUX.2's forward, with its negative rows beside
    caches_mixed_sizes: ClassVar[bool] = True  # FLUX.2's forward
    packs_sizes: ClassVar[bool] = True  # FLUX.2's forward

    def uses_cfg(self, request: GenerationRequest) -> bool:
        # The call's `do_classifier_free_guidance`; the empty prompt is the negative rows'.
        distilled = bool(self.pipe.config.get("is_distilled", False))
        return resolved(request.params.guidance_scale) > 1 and not distilled
