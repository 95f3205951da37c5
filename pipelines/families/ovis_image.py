"""Ovis-Image: text-to-image, request-level and step-level.

Ovis-Image is FLUX.1's layout (packing, schedule, decode: it subclasses `Flux` once) over a
different text side, as `OvisImagePipeline.__call__` runs it: the last hidden state of Qwen3
over a fixed system prompt and the user's prompt in the chat template, padded to 256 tokens
past the 28 it drops, with the padding zeroed and no mask, text positions (0, i, i) and no
pooled vector or guidance input; classifier-free guidance as a second forward (`u + s·(c - u)`
with the negative prompt, "" without one) for scales above 1. Every row's text is 256 tokens,
so rows of any prompt share a forward.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.families.base import TaskUse
from pipelines.families.flux import Flux
from pipelines.families.policies import CLASSIFIER_FREE, Guidance
from pipelines.stepping.padded_grid import PaddedGrid, row_grids
from pipelines.stepping.setup import encode_together
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task

_TEXT = "encoder_hidden_states"
# OvisImagePipeline.__call__'s default: every prompt is this many tokens after the dropped prefix.
_MAX_SEQUENCE_LENGTH = 256


class OvisImage(Flux):
    """Ovis-Image: 50 steps and guidance 5 by default (every request has negative rows above 1)."""

    uses: ClassVar[tuple[TaskUse, ...]] = (TaskUse(TEXT_TO_IMAGE, "OvisImagePipeline"),)
    key_name: ClassVar[str] = "ovis-image"
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 5.0
    default_true_cfg_scale: ClassVar[float | None] = None
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE
    # Its blocks differ from FLUX.1's (SwiGLU, its own timestep embedding), which
    # `pipelines.packed_flux` mirrors, so it pads (`Flux.denoise`'s grid) and does not pack.
    mixes_sizes_why: ClassVar[str] = "padded to one grid, an attention mask over its empty places"

    def cached_denoiser(self) -> torch.nn.Module | None:
        # diffusers' block registry does not know Ovis-Image's block classes (see Chroma).
        return None

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        return (self.pipe.transformer,)  # step mode's hooks know them (`pipelines.cache.block_args`)

    def first_block_steps(self) -> bool:
        return True

    def max_sequence_length(self) -> int:
        return _MAX_SEQUENCE_LENGTH

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"guidance_scale": params.guidance_scale, "max_sequence_length": _MAX_SEQUENCE_LENGTH}

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, *_ = self.pipe.encode_prompt(
                prompt=texts,
                do_classifier_free_guidance=False,
                device=self.device,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
            )
            return (embeds,)

        return encode_together(requests, self.uses_cfg, encode, lambda r, rows: {_TEXT: rows[0]})

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        pipe = self.pipe
        text = cond[_TEXT]
        grid = PaddedGrid.of(row_grids(self, states), latents.device)
        # Positions shared by every row (one text length; rows of different sizes on one grid,
        # `PaddedGrid`): the text's (0, i, i), as `_prepare_prompt_embeds` makes them, and the
        # image's.
        positions = torch.arange(text.shape[1], dtype=torch.float32)
        text_ids = torch.stack([torch.zeros_like(positions), positions, positions], dim=1)
        image_ids = pipe._prepare_latent_image_ids(
            latents.shape[0], grid.rows, grid.cols, latents.device, latents.dtype
        )
        out: Tensor = pipe.transformer(
            hidden_states=grid.spread(latents),
            timestep=timesteps.to(latents.dtype) / 1000,
            encoder_hidden_states=text,
            txt_ids=text_ids.to(text.device, text.dtype),
            img_ids=image_ids,
            joint_attention_kwargs=grid.attention_kwargs(text.shape[1]),
            return_dict=False,
        )[0]
        return grid.gather(out, latents.shape[1])
