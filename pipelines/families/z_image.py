"""Z-Image and Z-Image-Turbo: text-to-image, image-to-image and inpainting (the same weights
through `ZImageImg2ImgPipeline` and `ZImageInpaintPipeline`), request-level and step-level.

The stages follow `ZImagePipeline.__call__`: Qwen3's second-to-last hidden state trimmed to
each prompt's own tokens, float32 latents from each request's generators (not packed: the
transformer patchifies them itself), a flow-matching schedule of its own (sigmas
1 → 1/steps, shifted by `mu` from the image's token count), and the transformer over lists
of rows at (1000 - t) / 1000, whose prediction is negated before the scheduler step.

Each row keeps its caption at its own length: the transformer pads every caption to a
multiple of 32 itself and starts the image's positions after that padded length, so
padding captions to a common length would move the image's RoPE and change the picture.
Captions travel zero-padded to `_MAX_SEQUENCE_LENGTH` with their lengths, so rows of any
prompt length concatenate, and are cut back to their own length for the forward.

Guidance is classifier-free as `pos + s·(pos - neg)`, on as soon as the scale is above 0
(Turbo runs at 0: no negative rows). `cfg_truncation` switches it off once the step's
normalised time passes it, and `cfg_normalization` caps the guided prediction's norm at
that many times the conditional one's, per image, as diffusers does.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from diffusers import DiffusionPipeline
from diffusers.pipelines.z_image.pipeline_z_image_img2img import retrieve_latents
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.cache.calls import denoiser_call
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import PATCHIFIED, Sizes
from pipelines.family_options import call_default
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, packed_flow_scheduler, packed_size
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded, padded_cat
from pipelines.tasks.base import TEXT_TO_IMAGE, Task
from pipelines.tasks.image_to_image import IMAGE_TO_IMAGE
from pipelines.tasks.inpainting import INPAINTING

# The caption rows (the image-input tasks read their dtype under this name) and their lengths.
_TEXT = "encoder_hidden_states"
_LENGTHS = "caption_lengths"
# ZImagePipeline.__call__'s default: the tokenizer pads (and truncates) to this many tokens.
_MAX_SEQUENCE_LENGTH = 512
# The pipelines' own default size: they read none from the config.
_DEFAULT_SIZE = 1024
# The transformer's default patch (2x2, one frame), which `denoise` calls it with.
_PATCH_AREA = 4


class ZImage(Family):
    """Z-Image: guidance 5 by default (Z-Image-Turbo is run at 0, no guidance); a negative
    prompt ("" without one) matters whenever the scale is above 0."""

    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_IMAGE, "ZImagePipeline"),
        TaskUse(IMAGE_TO_IMAGE, "ZImageImg2ImgPipeline"),
        TaskUse(INPAINTING, "ZImageInpaintPipeline"),
    )
    key_name: ClassVar[str] = "z-image"
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 5.0
    sizes: ClassVar[Sizes] = Sizes(
        default=lambda pipe: (_DEFAULT_SIZE, _DEFAULT_SIZE), multiple=PATCHIFIED.multiple
    )
    flow_matching: ClassVar[bool] = True
    # Its transformer takes a list of rows of any size, each positioned by its own grid, and
    # masks the batch's padding itself: rows of different sizes share a forward as they are.
    mixes_sizes: ClassVar[bool] = True
    mixes_sizes_why: ClassVar[str] = "its transformer takes rows of any size as a list, masking their padding"
    mixing_tasks: ClassVar[tuple[Task, ...]] = (TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINTING)

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig, use: TaskUse) -> None:
        super().__init__(pipe, config, use)
        # The diffusers call's `cfg_truncation` (guidance off once (1000 - t) / 1000 exceeds it;
        # 1.0: never) and `cfg_normalization` (0: no cap; the call's default is False), for
        # every request: the served settings (`--cfg-truncation`, `--cfg-normalization`),
        # else the call's own defaults.
        options = config.options
        truncation, normalization = options.cfg_truncation, options.cfg_normalization
        self.cfg_truncation = float(
            call_default(pipe, "cfg_truncation") if truncation is None else truncation
        )
        self.cfg_normalization = float(
            call_default(pipe, "cfg_normalization") if normalization is None else normalization
        )

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        # Its transformer takes lists of rows, which diffusers' cache hooks (request mode) do
        # not cut; step mode's hooks run on its main layers' padded batch.
        transformer: torch.nn.Module = self.pipe.transformer
        return (transformer,)

    def first_block_steps(self) -> bool:
        return True

    def steps(self) -> bool:
        return True

    def uses_cfg(self, request: GenerationRequest) -> bool:
        # ZImagePipeline.do_classifier_free_guidance: any scale above 0, not above 1.
        return resolved(request.params.guidance_scale) > 0

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {
            **super().call_kwargs(params),
            "cfg_truncation": self.cfg_truncation,
            "cfg_normalization": self.cfg_normalization,
            "max_sequence_length": _MAX_SEQUENCE_LENGTH,
        }

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            # A copy: `_encode_prompt` writes each templated prompt back into the list it gets.
            captions, _ = self.pipe.encode_prompt(
                list(texts),
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=_MAX_SEQUENCE_LENGTH,
            )
            # Lengths on the CPU: the forward cuts rows by them without waiting on a device.
            lengths = torch.tensor([len(caption) for caption in captions])
            padded = torch.stack([F.pad(c, (0, 0, 0, _MAX_SEQUENCE_LENGTH - len(c))) for c in captions])
            return padded, lengths

        return encode_together(
            requests, self.uses_cfg, encode, lambda r, rows: {_TEXT: rows[0], _LENGTHS: rows[1]}
        )

    def scheduler(self, request: GenerationRequest) -> Any:
        return packed_flow_scheduler(self.pipe, request, self.device)

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        pipe, params = self.pipe, request.params
        latents: Tensor = pipe.prepare_latents(
            params.n,
            pipe.transformer.in_channels,
            resolved(params.height),
            resolved(params.width),
            torch.float32,  # whatever the weights' dtype, as ZImagePipeline draws them
            self.device,
            generators,
        )
        return latents

    def token_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        """A row's image tokens (the transformer pads each row's sequence, not a 2-D grid)."""
        height, width = packed_size(self.pipe, request)
        return (height * width // _PATCH_AREA,)

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """The transformer over lists of rows (each with its own caption length, and its own
        size: rows of different sizes arrive zero-padded to the largest and go in cut back to
        their own), the prediction in float32 and negated, as the pipeline hands it to the
        scheduler, padded again as they came."""
        transformer = self.pipe.transformer
        lengths = cond[_LENGTHS].tolist()
        captions = [row[:length] for row, length in zip(cond[_TEXT], lengths, strict=True)]
        sizes = [packed_size(self.pipe, state.request) for state in states for _ in range(state.rows)]
        rows = [
            row[:, :height, :width].unsqueeze(1)
            for row, (height, width) in zip(latents.to(transformer.dtype).unbind(0), sizes, strict=True)
        ]
        # Each row's image tokens come first in its sequence, then its caption, padded to the
        # batch's longest: First-Block Cache compares and keeps only the image's.
        image_tokens = latents.shape[-2] * latents.shape[-1] // _PATCH_AREA
        with denoiser_call(image_tokens=image_tokens):
            out = transformer(rows, (1000 - timesteps) / 1000, captions, return_dict=False)[0]
        # Negating before guidance gives the same bits as after: every operation is odd.
        return -padded_cat([row.float()[None] for row in out]).squeeze(2)

    def guide(self, state: DenoiseState, uncond: Tensor, cond: Tensor) -> Tensor:
        """`cond + s·(cond - uncond)`, as the pipeline guides each image; no guidance past
        the truncation (computed on the device: no host sync), and the per-image norm cap."""
        t = state.timesteps[state.steps_done]
        scale = torch.where(
            ((1000 - t.float()) / 1000).double() > self.cfg_truncation,
            0.0,
            state.guidance_scale,
        ).to(cond.dtype)
        guided = cond + scale * (cond - uncond)
        if self.cfg_normalization > 0:
            dims = tuple(range(1, cond.ndim))
            kept = torch.linalg.vector_norm(cond, dim=dims, keepdim=True) * self.cfg_normalization
            norm = torch.linalg.vector_norm(guided, dim=dims, keepdim=True)
            guided = torch.where(norm > kept, guided * (kept / norm), guided)
        return guided

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe, vae = self.pipe, self.pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")

    # Input images: the pipelines' own encode (one row per generator, shifted and scaled) --

    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor:
        vae = self.pipe.vae
        pixels = pixels.to(self.device, dtype)
        sampled = [
            retrieve_latents(vae.encode(pixels[i : i + 1]), generator=generator)
            for i, generator in enumerate(generators)
        ]
        latents: Tensor = (torch.cat(sampled) - vae.config.shift_factor) * vae.config.scaling_factor
        return latents

    def noise_shape(self, request: GenerationRequest) -> tuple[int, ...]:
        height, width = packed_size(self.pipe, request)
        return (request.params.n, self.pipe.transformer.in_channels, height, width)

    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        # The pipeline also encodes the masked image (after the noise, so drawing nothing a
        # request's image depends on), which its transformer never reads.
        mask = F.interpolate(condition, size=packed_size(self.pipe, request), mode="nearest")
        return mask.to(self.device, dtype), None
