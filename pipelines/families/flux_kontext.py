"""FLUX.1-Kontext: an edit of one reference image (`FluxKontextPipeline`), request-level and
step-level.

Kontext [dev] is FLUX.1-dev's network (`pipelines.families.flux`: encoding, schedule, distilled
guidance, optional true CFG with a negative prompt) whose transformer also reads the
reference's VAE latents, packed like the noise and appended after it with position ids whose
first axis is 1 instead of 0 (`pipelines.tasks.references`).

Two sizes are the call's own: it rescales the requested size to `max_area` (1024² by default)
at its aspect ratio, so the adapter passes `max_area` = width·height and the request gets the
size it asked for; and with `_auto_resize` (the default) it resizes the reference to the
nearest in aspect of `PREFERRED_KONTEXT_RESOLUTIONS`, the ~1 MP sizes Kontext was trained at.
Those are sizes for its 8x VAE: a model with another VAE (the tiny one halves) keeps its
reference's own size, where a 1 MP reference would be 65,536 tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.families.base import TaskUse
from pipelines.families.flux import Flux
from pipelines.outputs import resolved
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.references import REFERENCE, REFERENCE_IDS, REFERENCE_LATENTS

# The VAE the preferred resolutions were chosen for (FLUX.1's: 8x).
_TRAINED_VAE_SCALE = 8


class FluxKontext(Flux):
    """FLUX.1-Kontext: 28 steps and guidance 3.5 (the call's defaults, FLUX.1's)."""

    uses: ClassVar[tuple[TaskUse, ...]] = (TaskUse(REFERENCE, "FluxKontextPipeline", name="FluxKontext"),)
    mixes_sizes: ClassVar[bool] = False
    mixes_sizes_why: ClassVar[str] = "each row's reference tokens follow its own: one layout per forward"
    key_name: ClassVar[str] = "flux-kontext"

    def auto_resize(self) -> bool:
        return int(self.pipe.vae_scale_factor) == _TRAINED_VAE_SCALE

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        area = resolved(params.width) * resolved(params.height)
        return {**super().call_kwargs(params), "max_area": area}

    def reference_call_kwargs(self) -> dict[str, Any]:
        return {"_auto_resize": self.auto_resize()}

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        # Kontext's `prepare_latents` takes the reference first; its noise is FLUX.1's.
        pipe, params = self.pipe, request.params
        latents, *_ = pipe.prepare_latents(
            None,
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

    def reference_sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]:
        """As the call sizes its reference: down to the size multiple, or the preferred
        resolution nearest in aspect ratio. Without an image (the engine's step budget
        measures a default request, which has none) the reference is taken at the output size."""
        multiple = int(self.pipe.vae_scale_factor) * 2
        if not request.input_images:
            return ((resolved(request.params.width), resolved(request.params.height)),)
        height, width = request.input_images[0].shape[:2]
        width, height = width - width % multiple, height - height % multiple
        if self.auto_resize() and width and height:
            _, width, height = min(
                (abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS
            )
        return ((width // multiple * multiple, height // multiple * multiple),)

    def reference_output_size(self, request: GenerationRequest) -> tuple[int, int]:
        return self.reference_sizes(request)[0]

    def check_references(self, request: GenerationRequest) -> None:
        # The image count is the task's to check (`Reference`); the budget's default has none.
        if not request.input_images:
            return
        multiple = int(self.pipe.vae_scale_factor) * 2
        height, width = request.input_images[0].shape[:2]
        if min(width, height) < multiple:
            raise InvalidRequestError(f"the image must be at least {multiple} pixels a side", "image")

    def add_references(self, request: GenerationRequest, prompts: Encoded) -> None:
        """The reference as `prepare_latents` makes it: resized, encoded (the VAE's mode:
        nothing drawn), n rows, packed; ids (1, h, w)."""
        pipe, processor = self.pipe, self.pipe.image_processor
        ((width, height),) = self.reference_sizes(request)
        picture = processor.resize(Image.fromarray(request.input_images[0]), height, width)
        dtype = prompts[0]["encoder_hidden_states"].dtype
        pixels = processor.preprocess(picture, height, width).to(self.device, dtype)
        n, channels = request.params.n, self.latent_channels()
        with self.vae_lock:  # a decode may be running beside
            latents = pipe._encode_vae_image(image=pixels, generator=None)
        latents = torch.cat([latents] * n)
        side_h, side_w = latents.shape[2:]
        packed = pipe._pack_latents(latents, n, channels, side_h, side_w)
        ids = pipe._prepare_latent_image_ids(n, side_h // 2, side_w // 2, self.device, latents.dtype)
        ids[..., 0] = 1
        rows = ids.unsqueeze(0).expand(n, -1, -1)
        for conditioning in prompts:
            if conditioning is not None:
                conditioning.update({REFERENCE_LATENTS: packed, REFERENCE_IDS: rows})
