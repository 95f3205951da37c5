"""Text-to-image families with a transformer denoiser (SD3, FLUX, Qwen-Image): what differs
is defaults, size rules and how guidance is passed. Everything else (batching, seeds,
splitting) is the base class's.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.request import InvalidRequestError, SamplingParams
from pipelines.text_to_image import DiffusersTextToImage, resolved


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


class _TrueCfgTextToImage(_TransformerTextToImage):
    """Families with "true" CFG (Flux, Qwen-Image): as in diffusers, it runs only with
    `true_cfg_scale > 1` and a negative prompt, so having one is part of the batch key."""

    negative_prompt_in_key: ClassVar[bool] = True

    def guidance_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"guidance_scale": params.guidance_scale, "true_cfg_scale": params.true_cfg_scale}


class FluxTextToImage(_TrueCfgTextToImage):
    """FLUX: `guidance_scale` is the distilled guidance embedding (when the transformer has
    one, as FLUX.1-dev does); true CFG is off by default (`true_cfg_scale` 1)."""

    default_steps: ClassVar[int] = 28
    default_guidance_scale: ClassVar[float | None] = 3.5
    default_true_cfg_scale: ClassVar[float | None] = 1.0


class QwenImageTextToImage(_TrueCfgTextToImage):
    """Qwen-Image: true CFG scale 4 by default, applied when a request has a negative prompt;
    `guidance_scale` matters only for guidance-distilled checkpoints."""

    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = None
    default_true_cfg_scale: ClassVar[float | None] = 4.0

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        # One step gives sigma 1.0 with Qwen-Image's terminal shift: 0/0 in diffusers, NaN images.
        if resolved(params.num_inference_steps) < 2:
            raise InvalidRequestError(
                "num_inference_steps must be at least 2 for Qwen-Image", "num_inference_steps"
            )
