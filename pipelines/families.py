"""What the transformer text-to-image families share (SD3, FLUX, Qwen-Image, each in its
own file): default size and size rules of a patchified transformer, and true CFG. The rest
(batching, seeds, splitting) is `DiffusersTextToImage`'s.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.request import GenerationRequest, SamplingParams
from pipelines.text_to_image import DiffusersTextToImage, resolved


class TransformerTextToImage(DiffusersTextToImage):
    """Families whose denoiser is a patchified transformer (SD3, Flux, Qwen-Image)."""

    def model_default_size(self) -> tuple[int, int]:
        side = int(self.pipe.default_sample_size) * int(self.pipe.vae_scale_factor)
        return side, side

    def model_size_multiple(self) -> int:
        # Latents are packed into 2x2 patches; other sizes are silently resized or refused.
        return int(self.pipe.vae_scale_factor) * 2


class TrueCfgTextToImage(TransformerTextToImage):
    """Families with "true" CFG (Flux, Qwen-Image): as in diffusers, it runs only with
    `true_cfg_scale > 1` and a negative prompt, so having one is part of the batch key."""

    negative_prompt_in_key: ClassVar[bool] = True

    def _uses_cfg(self, request: GenerationRequest) -> bool:
        """Whether a request runs true CFG, as the request-level forward decides it (an empty
        negative prompt is no negative prompt)."""
        params = request.params
        return resolved(params.true_cfg_scale) > 1 and bool(params.negative_prompt)

    def guidance_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        # Without a negative prompt (the whole batch: it is in the key) true CFG is off
        # whatever the scale; passing 1 says so and keeps diffusers from warning on every call.
        true_cfg = params.true_cfg_scale if params.negative_prompt else 1.0
        return {"guidance_scale": params.guidance_scale, "true_cfg_scale": true_cfg}
