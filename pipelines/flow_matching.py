"""The `_prepare` hooks that the packed flow-matching families (FLUX, Qwen-Image) share: a
flow-matching schedule of the request's own, shifted by `mu` from its image's token count,
and the request's state at its first step, guided by its true CFG scale. Their
image-to-image and inpainting (pipelines/image_to_image.py, pipelines/inpainting.py) draw
latents of their own and go through the same two hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.request_setup import Encoded, flow_scheduler
from pipelines.stepping import DenoiseState
from pipelines.text_to_image import resolved


class PackedFlowMatching:
    """Mixed in before a family whose latents are packed in 2x2 patches (a token covers
    2 * `vae_scale_factor` pixels a side) and whose scheduler is flow matching."""

    pipe: Any
    device: torch.device

    def _own_scheduler(self, request: GenerationRequest) -> Any:
        """The request's own flow-matching schedule, `mu` from its image's token count."""
        params, side = request.params, self.pipe.vae_scale_factor * 2
        tokens = (resolved(params.height) // side) * (resolved(params.width) // side)
        steps = resolved(params.num_inference_steps)
        return flow_scheduler(
            self.pipe.scheduler, steps, tokens, self.device, linear_sigmas=self._linear_sigmas()
        )

    def _linear_sigmas(self) -> bool:
        """Sigmas 1 → 1/steps, as the family's diffusers pipeline sets them (else the
        scheduler's own for the step count)."""
        return True

    def _state(
        self,
        request: GenerationRequest,
        scheduler: Any,
        latents: Tensor,
        generators: list[torch.Generator],
        prompts: Encoded,
        *,
        first_step: int = 0,
    ) -> DenoiseState:
        """The request at its first step, guided by its true CFG scale."""
        return DenoiseState.start(
            request,
            scheduler,
            latents,
            prompts=prompts,
            guidance_scale=resolved(request.params.true_cfg_scale),
            generators=generators,
            first_step=first_step,
        )
