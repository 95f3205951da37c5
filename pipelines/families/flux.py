"""FLUX.1: text-to-image, image-to-image and inpainting (its text-to-image weights through
`FluxImg2ImgPipeline` and `FluxInpaintPipeline`), request-level and step-level.

The stages follow `FluxPipeline.__call__`: CLIP pooled and T5 prompt embeddings (T5 padded
to `max_sequence_length`, so every prompt has the same length and rows concatenate), packed
latents from each request's generators, a flow-matching schedule of its own (sigmas
1 → 1/steps, shifted by `mu` from the image's token count), the transformer with a per-row
timestep / 1000 and — for guidance-distilled checkpoints such as FLUX.1-dev — a per-row
guidance embedding, and true CFG only for requests with a negative prompt and
`true_cfg_scale > 1`. Every task takes ControlNets (`pipelines.controlnet_flux`: their
residuals go into the transformer's forward, per row), IP-Adapters (`pipelines.ip_adapter_flux`:
image attention per row in the double-stream blocks) or a Redux prior (`pipelines.redux_flux`:
a request's reference images become its text at prepare). FLUX.1-Kontext and FLUX.1 Fill are small
subclasses in their own files.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.controlnet_flux import FluxControlNets
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import PATCHIFIED, TRUE_CFG, Guidance, Sizes
from pipelines.ip_adapter_flux import FluxIPAdapters
from pipelines.outputs import resolved
from pipelines.packed_flux import packed_forward
from pipelines.redux_flux import FluxRedux
from pipelines.stepping.packed_rows import PackedRows
from pipelines.stepping.padded_grid import PaddedGrid, row_grids
from pipelines.stepping.setup import (
    encode_together,
    guidance_rows,
    packed_flow_scheduler,
    packed_mask,
    packed_size,
)
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task
from pipelines.tasks.image_to_image import IMAGE_TO_IMAGE
from pipelines.tasks.inpainting import INPAINTING
from pipelines.tasks.references import REFERENCE_IDS, REFERENCE_LATENTS

# FluxPipeline.__call__'s default: T5 pads every prompt to this many tokens.
_MAX_SEQUENCE_LENGTH = 512


class Flux(Family):
    """FLUX: `guidance_scale` is the distilled guidance embedding (when the transformer has
    one, as FLUX.1-dev does); true CFG is off by default (`true_cfg_scale` 1)."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_IMAGE, "FluxPipeline"),
        TaskUse(IMAGE_TO_IMAGE, "FluxImg2ImgPipeline"),
        TaskUse(INPAINTING, "FluxInpaintPipeline"),
    )
    key_name: ClassVar[str] = "flux"
    default_steps: ClassVar[int] = 28
    default_guidance_scale: ClassVar[float | None] = 3.5
    default_true_cfg_scale: ClassVar[float | None] = 1.0
    guidance: ClassVar[Guidance] = TRUE_CFG
    sizes: ClassVar[Sizes] = PATCHIFIED
    flow_matching: ClassVar[bool] = True
    mixes_sizes: ClassVar[bool] = True
    mixes_sizes_why: ClassVar[str] = (
        "packed end to end, one attention document each (padded to one grid under a cache, "
        "ControlNet or IP-Adapter)"
    )
    # Image-to-image and inpainting (FLUX's own text-to-image weights: the input goes back
    # outside the mask after each step, per request, at its own size).
    mixing_tasks: ClassVar[tuple[Task, ...]] = (TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINTING)
    splits_cfg: ClassVar[bool] = True
    caches_mixed_sizes: ClassVar[bool] = True  # its rows' places told the cache (`PaddedGrid.own_tokens`)
    packs_sizes: ClassVar[bool] = True  # `pipelines.packed_flux`, for requests without cache or adapters
    splits_tokens: ClassVar[bool] = True
    ip_attention_in_blocks: ClassVar[bool] = True
    controlnets: FluxControlNets | None

    def steps(self) -> bool:
        return True

    def cached_denoiser(self) -> torch.nn.Module | None:
        transformer: torch.nn.Module = self.pipe.transformer
        return transformer

    def max_sequence_length(self) -> int:
        """T5's padded length: 512 (diffusers' default), or less when the tokenizer says its
        model was trained on fewer tokens (shapes-dit: 32). FLUX gives T5 no attention mask,
        so padding beyond what the model learnt changes every image."""
        return min(_MAX_SEQUENCE_LENGTH, int(self.pipe.tokenizer_2.model_max_length))

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {**super().call_kwargs(params), "max_sequence_length": self.max_sequence_length()}

    def latent_channels(self) -> int:
        """The VAE latent's channels: a quarter of the transformer's input (2x2 packed)."""
        return int(self.pipe.transformer.config.in_channels) // 4

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=texts,
                prompt_2=None,
                device=self.device,
                max_sequence_length=self.max_sequence_length(),
            )
            return embeds, pooled

        encoded = encode_together(
            requests, self.uses_cfg, encode, lambda r, rows: self._conditioning(r, *rows)
        )
        if self.redux is None:
            return encoded
        return [
            self._with_redux(request, prompts) for request, prompts in zip(requests, encoded, strict=True)
        ]

    def _with_redux(self, request: GenerationRequest, prompts: Encoded) -> Encoded:
        """A Redux request's text from its prior (`pipelines.redux_flux`; it takes no true CFG)."""
        redux = self.redux
        if redux is None or not any(ref.name == redux.name for ref in request.ip_adapters):
            return prompts
        embeds, pooled = redux.rows(request, request.params.n, self.device)
        return self._conditioning(request, embeds, pooled), prompts[1]

    def _conditioning(self, request: GenerationRequest, embeds: Tensor, pooled: Tensor) -> Conditioning:
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = guidance_rows(embeds, resolved(request.params.guidance_scale))
        return cond

    def scheduler(self, request: GenerationRequest) -> Any:
        # FluxPipeline's sigmas 1 → 1/steps, unless the scheduler asks for its own
        # (`use_flow_sigmas`); the img2img and inpainting pipelines set them whatever it says.
        own = self.use.task is TEXT_TO_IMAGE and self.pipe.scheduler.config.get("use_flow_sigmas")
        return packed_flow_scheduler(self.pipe, request, self.device, linear_sigmas=not own)

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        pipe, params = self.pipe, request.params
        latents, _ = pipe.prepare_latents(
            params.n,
            self.latent_channels(),
            resolved(params.height),
            resolved(params.width),
            cond["encoder_hidden_states"].dtype,
            self.device,
            generators,
        )
        noise: Tensor = latents
        return noise

    def token_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        height, width = packed_size(self.pipe, request)
        return height // 2, width // 2

    def sequence_lengths(self, params: SamplingParams) -> dict[str, int]:
        # The plan cuts `encoder_hidden_states` with `txt_ids`, `hidden_states` with
        # `img_ids`: one token per 2x2 patch of latents (`token_grid`).
        side = self.pipe.vae_scale_factor * 2
        image = (resolved(params.height) // side) * (resolved(params.width) // side)
        return {"text": self.max_sequence_length(), "image": image}

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """The transformer over the rows. Text positions are shared by every row (T5 pads
        every prompt to the same length). Rows of different sizes are packed end to end where
        every request of the forward packs (`_packed`); else laid on the grid that holds them
        all, with a mask over its empty places (`PaddedGrid`), so the batch's one set of image
        positions gives each row's tokens their own image's."""
        pipe = self.pipe
        grids = row_grids(self, states)
        if self.packs_forward(states, grids):
            return self._packed(grids, latents, timesteps, cond)
        grid = PaddedGrid.of(grids, latents.device)
        text = cond["encoder_hidden_states"]
        text_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)
        image_ids = pipe._prepare_latent_image_ids(
            latents.shape[0], grid.rows, grid.cols, latents.device, latents.dtype
        )
        hidden = grid.spread(latents)
        if REFERENCE_LATENTS in cond:  # Kontext (one size): the reference's tokens after the noise's
            hidden = torch.cat([latents, cond[REFERENCE_LATENTS]], dim=1)
            image_ids = torch.cat([image_ids, cond[REFERENCE_IDS][0]], dim=0)
        timestep = timesteps.to(latents.dtype) / 1000
        residuals = None
        if self.controlnets is not None:
            residuals = self.controlnets.residuals(states, latents, timestep, cond, grid)
        with self._ip_adapters_applied(states, latents.dtype), grid.own_tokens():
            out: Tensor = pipe.transformer(
                hidden_states=self.denoiser_input(hidden, cond),
                timestep=timestep,
                guidance=cond.get("guidance"),
                pooled_projections=cond["pooled_projections"],
                encoder_hidden_states=text,
                txt_ids=text_ids,
                img_ids=image_ids,
                joint_attention_kwargs=grid.attention_kwargs(text.shape[1]),
                return_dict=False,
                **(residuals or {}),
            )[0]
        return grid.gather(out, latents.shape[1])

    def _packed(
        self, grids: list[tuple[int, ...]], latents: Tensor, timesteps: Tensor, cond: Conditioning
    ) -> Tensor:
        """The transformer over rows of several sizes packed end to end, one attention
        document each (`pipelines.packed_flux`): each row's own image positions, no padding."""
        pipe, device, dtype = self.pipe, latents.device, latents.dtype
        text = cond["encoder_hidden_states"]
        packed = PackedRows.of(text.shape[1], tuple(height * width for height, width in grids), device)
        image_ids = torch.cat(
            [
                pipe._prepare_latent_image_ids(1, height, width, device, dtype)
                for height, width in packed.in_order(grids)
            ]
        )
        return packed_forward(
            pipe.transformer,
            packed,
            latents,
            timestep=timesteps.to(dtype) / 1000,
            guidance=cond.get("guidance"),
            pooled=cond["pooled_projections"],
            text=text,
            image_ids=image_ids,
        )

    def _ip_adapters_applied(self, states: list[Any], dtype: torch.dtype) -> AbstractContextManager[None]:
        """The transformer's forward with the rows' reference images (`pipelines.ip_adapter_flux`)."""
        if self.ip_adapters is None:
            return nullcontext()
        return self.ip_adapters.applied(states, dtype)

    def takes_controlnet(self) -> bool:
        # FluxControlNetPipeline, FluxControlNetImg2ImgPipeline, FluxControlNetInpaintPipeline.
        return type(self) is Flux and self.steps()

    def load_controlnets(self, sources: tuple[tuple[str, str], ...]) -> FluxControlNets:
        # On one device: the settings refuse `--controlnet` with `--cfg-parallel` (a lane's
        # negative rows would need the positive rows' residuals, computed on another device)
        # and `--sequence-parallel` (the residuals are not cut by tokens).
        return FluxControlNets.load(self.pipe, sources)

    def takes_ip_adapter(self) -> bool:
        # FluxPipeline's `ip_adapter_image` (FluxImg2ImgPipeline's and FluxInpaintPipeline's
        # too): the image attention enters the double-stream blocks' image stream only, so a
        # task's latents are as without an adapter. Not Kontext or Fill (their own files).
        return type(self) is Flux and self.steps()

    def load_ip_adapters(self, sources: tuple[tuple[str, str], ...]) -> FluxIPAdapters:
        return FluxIPAdapters.load(self.pipe, sources)

    def takes_redux(self) -> bool:
        # FluxPipeline, FluxImg2ImgPipeline and FluxInpaintPipeline all take `prompt_embeds`.
        return self.takes_ip_adapter()

    def load_redux(self, name: str, source: str) -> FluxRedux:
        return FluxRedux.load(self.pipe, name, source)

    def denoiser_input(self, hidden: Tensor, cond: Conditioning) -> Tensor:
        """The transformer's `hidden_states` (FLUX Fill adds channels)."""
        return hidden

    def latent_grid(self, states: list[Any], latents: Tensor) -> Tensor:
        params = states[0].request.params
        grid: Tensor = self.pipe._unpack_latents(
            latents, resolved(params.height), resolved(params.width), self.pipe.vae_scale_factor
        )
        return grid

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        latents = self.latent_grid(states, latents)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")

    # Input images: the pipelines' own `_encode_vae_image` (shifted and scaled latents) -----

    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor:
        encoded: Tensor = self.pipe._encode_vae_image(pixels.to(self.device, dtype), generators)
        return encoded

    def noise_shape(self, request: GenerationRequest) -> tuple[int, ...]:
        height, width = packed_size(self.pipe, request)
        return (request.params.n, self.latent_channels(), height, width)

    def pack(self, latents: Tensor, request: GenerationRequest) -> Tensor:
        height, width = packed_size(self.pipe, request)
        channels = self.latent_channels()
        packed: Tensor = self.pipe._pack_latents(latents, request.params.n, channels, height, width)
        return packed

    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        # The pipeline also encodes the masked image, which its transformer never reads.
        return packed_mask(self.pipe, request, condition, self.device, dtype), None
