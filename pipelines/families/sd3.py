"""Stable Diffusion 3 / 3.5: text-to-image, request-level and step-level, following
`StableDiffusion3Pipeline.__call__`: two CLIP and one T5 encoders (CLIP padded to 77 tokens
and T5 to `max_sequence_length`, so every prompt has the same length and rows
concatenate), latents from each request's generators, a flow-matching schedule of its own
(shifted by `mu` where the scheduler uses dynamic shifting), the MMDiT with a per-row
timestep, and classifier-free guidance above 1.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import PATCHIFIED, Sizes
from pipelines.outputs import resolved
from pipelines.packed_sd3 import packed_forward
from pipelines.stepping.packed_rows import PackedRows
from pipelines.stepping.padded_grid import row_grids
from pipelines.stepping.setup import encode_together, flow_scheduler
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task

# StableDiffusion3Pipeline.__call__'s default: T5 pads every prompt to this many tokens.
_MAX_SEQUENCE_LENGTH = 256


class StableDiffusion3(Family):
    uses: ClassVar[tuple[TaskUse, ...]] = (TaskUse(TEXT_TO_IMAGE, "StableDiffusion3Pipeline"),)
    key_name: ClassVar[str] = "sd3"
    default_steps: ClassVar[int] = 28
    default_guidance_scale: ClassVar[float | None] = 7.0
    sizes: ClassVar[Sizes] = PATCHIFIED
    flow_matching: ClassVar[bool] = True
    # Packed (`pipelines.packed_sd3`), never padded: diffusers 0.42.1's
    # `JointAttnProcessor2_0` drops any attention mask, so padding would be attended.
    mixes_sizes: ClassVar[bool] = True
    packs_sizes: ClassVar[bool] = True
    pads_sizes: ClassVar[bool] = False
    mixes_sizes_why: ClassVar[str] = (
        "packed end to end, one attention document each (one group per size under a cache: "
        "its attention takes no mask to pad with)"
    )

    def steps(self) -> bool:
        return True

    def cached_denoiser(self) -> torch.nn.Module | None:
        transformer: torch.nn.Module = self.pipe.transformer
        return transformer

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
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

        return encode_together(requests, self.uses_cfg, encode, conditioning)

    def _latent_size(self, request: GenerationRequest) -> tuple[int, int]:
        scale = self.pipe.vae_scale_factor
        return resolved(request.params.height) // scale, resolved(request.params.width) // scale

    def scheduler(self, request: GenerationRequest) -> Any:
        height, width = self._latent_size(request)
        patch = self.pipe.transformer.config.patch_size
        return flow_scheduler(
            self.pipe.scheduler,
            resolved(request.params.num_inference_steps),
            (height // patch) * (width // patch),
            self.device,
            linear_sigmas=False,  # SD3 lets the scheduler space its own sigmas
            max_shift=1.16,  # SD3's default, where FLUX and Qwen-Image use 1.15
        )

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        height, width = self._latent_size(request)
        shape = (request.params.n, self.pipe.transformer.config.in_channels, height, width)
        dtype = cond["encoder_hidden_states"].dtype
        noise: Tensor = randn_tensor(shape, generator=generators, device=self.device, dtype=dtype)
        return noise

    def token_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        height, width = self._latent_size(request)
        patch = self.pipe.transformer.config.patch_size
        return height // patch, width // patch

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """The MMDiT over the rows; rows of several sizes packed end to end, one attention
        document each (`pipelines.packed_sd3`), each row's latent at the top left of the
        batch's (`padded_cat`) and its prediction returned there."""
        grids = row_grids(self, states)
        if self.packs_forward(states, grids):
            text = cond["encoder_hidden_states"]
            packed = PackedRows.of(
                text.shape[1], tuple(height * width for height, width in grids), latents.device
            )
            return packed_forward(
                self.pipe.transformer,
                packed,
                latents,
                grids=grids,
                timestep=timesteps,
                pooled=cond["pooled_projections"],
                text=text,
            )
        out: Tensor = self.pipe.transformer(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            return_dict=False,
        )[0]
        return out

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe = self.pipe
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")
