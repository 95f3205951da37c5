"""Qwen-Image-Edit-Plus (2509, 2511) references, step by step: what
`QwenImageEditPlusPipeline.__call__` does with a request's one to three input images,
written so that several requests can share a text-encoder call and a denoiser forward.

Each input image is used twice: resized to about 384x384 pixels for Qwen2.5-VL, which reads
it beside the prompt ("Picture 1: <image> Picture 2: <image> ... prompt"), and to about
1024x1024 for the VAE, whose packed latents follow the noise in the denoiser's sequence.
diffusers builds the prompt's picture slots from the call's image list, so one call cannot
give two prompts different images (it refuses batches); `prompt_embeds` builds each text's
slots from its own request's images and hands the processor every image in slot order.

The areas are read from diffusers' module at each call (not copied), so what the stock
call does is what a request here does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
from PIL import Image
from torch import Tensor

# The prompt's picture slot, as `QwenImageEditPlusPipeline._get_qwen_prompt_embeds` writes it.
_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


def _sized(image: np.ndarray, area: int) -> tuple[int, int]:
    height, width = image.shape[:2]
    calculated_width, calculated_height = edit_plus.calculate_dimensions(area, width / height)
    return int(calculated_width), int(calculated_height)


def reference_sizes(images: tuple[np.ndarray, ...]) -> tuple[tuple[int, int], ...]:
    """(width, height) the VAE sees each input image at: its aspect ratio at ~1024x1024."""
    return tuple(_sized(image, edit_plus.VAE_IMAGE_SIZE) for image in images)


def output_size(images: tuple[np.ndarray, ...], multiple: int) -> tuple[int, int]:
    """The call's default (width, height): the LAST image's aspect ratio at ~1024x1024,
    down to the size multiple."""
    width, height = _sized(images[-1], edit_plus.VAE_IMAGE_SIZE)
    return width // multiple * multiple, height // multiple * multiple


def condition_images(pipe: Any, images: tuple[np.ndarray, ...]) -> list[Image.Image]:
    """The input images as Qwen2.5-VL reads them: each at its aspect ratio at ~384x384."""
    resized = []
    for image in images:
        width, height = _sized(image, edit_plus.CONDITION_IMAGE_SIZE)
        resized.append(pipe.image_processor.resize(Image.fromarray(image), height, width))
    return resized


def vae_pixels(pipe: Any, images: tuple[np.ndarray, ...]) -> list[Tensor]:
    """The input images as the VAE takes them: (1, 3, 1, H, W) each, at their reference size."""
    return [
        pipe.image_processor.preprocess(Image.fromarray(image), height, width).unsqueeze(2)
        for image, (width, height) in zip(images, reference_sizes(images), strict=True)
    ]


def prompt_embeds(
    pipe: Any, texts: list[str], images: list[list[Image.Image]], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Embeddings and mask of each text read with its own images (`images[i]` for
    `texts[i]`), in one text-encoder call: `_get_qwen_prompt_embeds` with a picture list per
    text. Rows are trimmed to their tokens after the template's prefix and padded with zeros."""
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    prompts = [
        template.format("".join(_PICTURE.format(i + 1) for i in range(len(own))) + text)
        for text, own in zip(texts, images, strict=True)
    ]
    flat = [image for own in images for image in own]
    inputs = pipe.processor(text=prompts, images=flat or None, padding=True, return_tensors="pt").to(device)
    hidden = pipe.text_encoder(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        pixel_values=inputs.get("pixel_values"),
        image_grid_thw=inputs.get("image_grid_thw"),
        output_hidden_states=True,
    ).hidden_states[-1]
    rows = [row[drop:] for row in pipe._extract_masked_hidden(hidden, inputs["attention_mask"])]
    longest = max(row.shape[0] for row in rows)
    embeds = torch.stack([torch.cat([row, row.new_zeros(longest - len(row), row.shape[1])]) for row in rows])
    mask = torch.stack([torch.arange(longest, device=embeds.device) < row.shape[0] for row in rows]).long()
    return embeds.to(pipe.text_encoder.dtype), mask
