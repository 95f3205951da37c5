"""Qwen-Image 2.1's reference images as `QwenImage21Pipeline.__call__` prepares them: each
sized to the area of `output_resolution` squared (its aspect kept, sides rounded to 32),
converted to RGBA, resized for the text encoder, and VAE-encoded (the mode) into packed tokens.

One concept with its own diffusers helpers (`calculate_dimensions`, the image processor), read
by the family's reference hooks (`pipelines.families.qwen_image_21`) and its text encoding,
so it lives apart from the family's stages. The resolution is the caller's: the family reads
it live from its config (a test changes it after loading).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest, InvalidRequestError

# References per request. diffusers sets no cap (its template numbers <image1>, <image2> ...
# as many as it is given); three, as Qwen-Image-Edit-Plus takes, and the tiny model's
# tokenizer knows <image1> to <image3> as words.
MAX_REFERENCES = 3


@dataclass(frozen=True, slots=True)
class References:
    """A request's references as the call sizes them at `resolution` (`output_resolution`:
    the configured `--reference-resolution`, else the call's default)."""

    pipe: DiffusionPipeline
    resolution: int

    def sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]:
        """(width, height) of each reference as the call sizes it: its aspect ratio at the
        area of `output_resolution` squared, sides rounded to 32."""
        area = self.resolution**2
        sizes = []
        for image in request.input_images:
            width, height, _ = calculate_dimensions(area, image.shape[1] / image.shape[0])
            sizes.append((int(width), int(height)))
        return tuple(sizes)

    def reduced(self, request: GenerationRequest) -> GenerationRequest:
        """Each reference larger than its size in the call (`sizes`) resized to it as the call
        resizes it (RGBA, the processor's Lanczos), where the call then takes the result as it
        is: where that size is the one the call computes from its own aspect ratio. The text
        encoder and the VAE then get the same pixels as from the upload, and a 4K upload waits
        in the queue at about `output_resolution` squared. Where the sides' rounding to 32
        moves that size (about a fifth of aspect ratios), the upload waits as sent: reduced,
        the call would resize it a second time."""
        area, resize = self.resolution**2, self.pipe.image_processor.resize
        images = []
        for sent, (width, height) in zip(request.input_images, self.sizes(request), strict=True):
            smaller = width * height < sent.shape[0] * sent.shape[1]
            if smaller and calculate_dimensions(area, width / height)[:2] == (width, height):
                picture = resize(Image.fromarray(sent).convert("RGBA"), width=width, height=height)
                images.append(np.asarray(picture.convert("RGB")))
            else:
                images.append(sent)
        if all(new is old for new, old in zip(images, request.input_images, strict=True)):
            return request
        return replace(request, input_images=tuple(images), input_digest=None)

    def check(self, request: GenerationRequest, minimum_side: int) -> None:
        """Raise `InvalidRequestError` (naming `image`) for a reference whose aspect ratio
        leaves a side under `minimum_side` pixels at the call's size."""
        for image, (width, height) in zip(request.input_images, self.sizes(request), strict=True):
            if min(width, height) < minimum_side:
                raise InvalidRequestError(
                    f"each image's aspect ratio must leave both sides at least {minimum_side} pixels at "
                    f"{self.resolution}x{self.resolution} pixels' area, got {image.shape[1]}x"
                    f"{image.shape[0]}",
                    "image",
                )

    def encoder_pictures(self, request: GenerationRequest) -> list[Image.Image]:
        """The references as the call hands them to the text encoder: resized RGBA."""
        resize = self.pipe.image_processor.resize
        return [resize(picture, width=width, height=height) for picture, width, height in self._rgba(request)]

    def latents(self, request: GenerationRequest, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The references' packed VAE latents (the mode, as `prepare_latents` encodes them),
        in reference order along the tokens, n rows each; the caller holds the VAE's lock."""
        pipe, n = self.pipe, request.params.n
        packed = []
        for picture, width, height in self._rgba(request):
            # (1, 4, 1, H, W), from the image as sent, as the call preprocesses it.
            pixels = pipe.image_processor.preprocess(picture, width=width, height=height).unsqueeze(2)
            latents = pipe._encode_vae_image(pixels.to(device, dtype), None)
            rows, columns = latents.shape[3:]
            latents = torch.cat([latents] * n)
            packed.append(pipe._pack_latents(latents, n, latents.shape[1], rows, columns))
        return torch.cat(packed, dim=1)

    def _rgba(self, request: GenerationRequest) -> list[tuple[Image.Image, int, int]]:
        """Each reference as sent, in RGBA as the call converts it, with its (width, height)."""
        sizes = self.sizes(request)
        return [
            (Image.fromarray(image).convert("RGBA"), width, height)
            for image, (width, height) in zip(request.input_images, sizes, strict=True)
        ]
