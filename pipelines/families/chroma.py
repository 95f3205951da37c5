"""Chroma: text-to-image, image-to-image and inpainting (its weights through
`ChromaImg2ImgPipeline` and `ChromaInpaintPipeline`), request-level and step-level.

Chroma is FLUX.1's packing, schedule and decode (so it subclasses `Flux` once) with a
different text side and guidance, as `ChromaPipeline.__call__` runs it: T5 alone (no CLIP,
no pooled vector) padded to 512 tokens with an attention mask that keeps one padding token
past each prompt, extended with ones over the image tokens and honoured by the
transformer, which has no guidance input; and classifier-free guidance as a second forward
(`u + s·(c - u)` with the negative prompt, "" without one) for scales above 1. Every row's
text is 512 tokens, so rows of any prompt share a forward with their masks stacked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from diffusers import ChromaPipeline, DiffusionPipeline
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.families.base import TaskUse
from pipelines.families.flux import Flux
from pipelines.families.policies import CLASSIFIER_FREE, Guidance
from pipelines.stepping.padded_grid import PaddedGrid, row_grids
from pipelines.stepping.setup import encode_together, packed_flow_scheduler
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task
from pipelines.tasks.image_to_image import IMAGE_TO_IMAGE
from pipelines.tasks.inpainting import INPAINTING

_TEXT = "encoder_hidden_states"
_MASK = "attention_mask"
# ChromaPipeline.__call__'s default: T5 pads every prompt to this many tokens.
_MAX_SEQUENCE_LENGTH = 512


class Chroma(Flux):
    """Chroma: 35 steps and guidance 5 by default (true CFG: every request has negative
    rows above 1)."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_IMAGE, "ChromaPipeline"),
        # FLUX's image primitives (`_encode_vae_image`, packing, the mask) over
        # ChromaImg2ImgPipeline and ChromaInpaintPipeline, which are FLUX's with Chroma's text
        # and guidance.
        TaskUse(IMAGE_TO_IMAGE, "ChromaImg2ImgPipeline"),
        TaskUse(INPAINTING, "ChromaInpaintPipeline"),
    )
    # Padded to one grid as FLUX.1's rows (`PaddedGrid`); its transformer squares the
    # text mask into a 0/1 additive bias, which cannot hide a key, so `_hiding` adds -inf.
    mixes_sizes: ClassVar[bool] = True
    mixes_sizes_why: ClassVar[str] = "padded to one grid, -inf added to its mask at the empty places"
    key_name: ClassVar[str] = "chroma"
    default_steps: ClassVar[int] = 35
    default_guidance_scale: ClassVar[float | None] = 5.0
    default_true_cfg_scale: ClassVar[float | None] = None
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE

    def cached_denoiser(self) -> torch.nn.Module | None:
        # diffusers' block registry (which its First-Block Cache needs to split the blocks)
        # does not know Chroma's block classes: request mode is refused at load and admission.
        return None

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        return (self.pipe.transformer,)  # step mode's hooks know them (`pipelines.cache.block_args`)

    def first_block_steps(self) -> bool:
        return True

    @classmethod
    def load_pipe(cls, use: TaskUse, config: PipelineConfig) -> DiffusionPipeline:
        pipe = super().load_pipe(use, config)
        if use.task is INPAINTING:
            # diffusers 0.42.1's ChromaInpaintPipeline.__call__ reads the transformer's
            # `guidance_embeds` (to build a guidance input its loop never passes), which
            # Chroma's transformer config has not: the call fails with AttributeError. Chroma
            # has no guidance embedding, so the flag is False; only the request-level call
            # reads it.
            pipe.transformer.register_to_config(guidance_embeds=False)
        return pipe

    def max_sequence_length(self) -> int:
        return _MAX_SEQUENCE_LENGTH

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"guidance_scale": params.guidance_scale, "max_sequence_length": _MAX_SEQUENCE_LENGTH}

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, _, mask, *_ = self.pipe.encode_prompt(
                prompt=texts,
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
            )
            return embeds, mask

        return encode_together(
            requests, self.uses_cfg, encode, lambda r, rows: {_TEXT: rows[0], _MASK: rows[1]}
        )

    def scheduler(self, request: GenerationRequest) -> Any:
        # ChromaPipeline's sigmas 1 -> 1/steps, whatever the scheduler's config says.
        return packed_flow_scheduler(self.pipe, request, self.device)

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """The transformer over the rows: text and image positions shared by every row, rows
        of different sizes laid on one grid (`PaddedGrid`), its empty places hidden."""
        pipe = self.pipe
        text = cond[_TEXT]
        grid = PaddedGrid.of(row_grids(self, states), latents.device)
        text_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)
        image_ids = ChromaPipeline._prepare_latent_image_ids(
            latents.shape[0], grid.rows, grid.cols, latents.device, latents.dtype
        )
        mask = pipe._prepare_attention_mask(latents.shape[0], grid.tokens, latents.dtype, cond[_MASK])
        with _hiding(pipe.transformer, grid, text.shape[1], mask.dtype):
            out: Tensor = pipe.transformer(
                hidden_states=grid.spread(latents),
                timestep=timesteps.to(latents.dtype) / 1000,
                encoder_hidden_states=text,
                txt_ids=text_ids,
                img_ids=image_ids,
                attention_mask=mask,
                return_dict=False,
            )[0]
        return grid.gather(out, latents.shape[1])


@contextmanager
def _hiding(transformer: Any, grid: PaddedGrid, text_tokens: int, dtype: torch.dtype) -> Iterator[None]:
    """While rows of different sizes step, every attention of the transformer gets -inf added
    at the grid's empty places (keys). Its blocks turn the (B, text + image) mask into
    `m[q] * m[k]` and SDPA adds that float mask to the scores: a product can zero a pair but
    never hide a key from a query whose own mask is 0 (a padding text token, which attends to
    everything alone), so the bias goes in after the product, on every block's attention."""
    if not grid.mixed:
        yield
        return
    hidden = ~grid.image_mask()
    bias = torch.zeros(hidden.shape[0], text_tokens + grid.tokens, dtype=dtype, device=hidden.device)
    bias[:, text_tokens:][hidden] = float("-inf")
    bias = bias[:, None, None, :]

    def hide(_module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return args, {**kwargs, "attention_mask": kwargs["attention_mask"] + bias}

    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    handles = [block.attn.register_forward_pre_hook(hide, with_kwargs=True) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
