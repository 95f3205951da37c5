"""Text-to-image families with a transformer denoiser (SD3; FLUX and Qwen-Image build on
these in their own files): what differs
is defaults, size rules and how guidance is passed. Everything else (batching, seeds,
splitting) is the base class's.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.request import SamplingParams
from pipelines.text_to_image import DiffusersTextToImage


class _TransformerTextToImage(DiffusersTextToImage):
    """Families whose denoiser is a patchified transformer (SD3, Flux, Qwen-Image)."""

    def model_default_size(self) -> tuple[int, int]:
        side = int(self.pipe.default_sample_size) * int(self.pipe.vae_scale_factor)
        return side, side

    def model_size_multiple(self) -> int:
        # Latents are packed into 2x2 patches; other sizes are silently resized or refused.
        return int(self.pipe.vae_scale_factor) * 2


class StableDiffusion3TextToImage(_TransformerTextToImage):
    default_steps: ClassVar[int] = 28
    default_guidance_scale: ClassVar[float | None] = 7.0

    def model_size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor) * int(self.pipe.patch_size)


class TrueCfgTextToImage(_TransformerTextToImage):
    """Families with "true" CFG (Flux, Qwen-Image): as in diffusers, it runs only with
    `true_cfg_scale > 1` and a negative prompt, so having one is part of the batch key."""

    negative_prompt_in_key: ClassVar[bool] = True

    def guidance_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"guidance_scale": params.guidance_scale, "true_cfg_scale": params.true_cfg_scale}
