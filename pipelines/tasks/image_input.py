"""What every task with one input image does with it: the output size it gives, the image at
the output size, as pixels the VAE takes, and (inpainting) the mask beside it.

The output size defaults to the input's. An inpainting request's mask is in diffusers'
convention (HxW uint8, 255 = repaint), the server having converted OpenAI's in one place
(`server.uploads.edit_mask`).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.outputs import resolved
from pipelines.tasks.family import TaskFamily


def size_of_input(family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
    """(width, height) of the input itself (not --default-size: a repainted photo keeps its
    size), down to the model's size multiple; None without an input."""
    if not request.input_images:
        return None
    height, width = request.input_images[0].shape[:2]
    step = family.size_multiple
    return max(step, width // step * step), max(step, height // step * step)


def input_at_size(request: GenerationRequest) -> np.ndarray:
    """The input image resized to the output size."""
    width, height = resolved(request.params.width), resolved(request.params.height)
    source = Image.fromarray(request.input_images[0])
    return np.asarray(source.resize((width, height), Image.Resampling.LANCZOS))


def input_pixels(family: TaskFamily, request: GenerationRequest) -> Tensor:
    """The input at the output size as diffusers hands it to the VAE, one row per image
    (n, 3, H, W), float32 in [-1, 1]: request mode's PIL images through the pipeline's own
    processor, memory layout included (a VAE's group norms over a flat area amplify the
    rounding that another layout gives)."""
    params = request.params
    image = Image.fromarray(input_at_size(request))
    processor = family.pipe.image_processor
    pixels: Tensor = processor.preprocess([image] * params.n, height=params.height, width=params.width)
    return pixels.to(torch.float32)


def inputs_at_size(request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
    """The input image and its mask at the output size (a request without a mask repaints
    everything, as an edit without a mask does at OpenAI)."""
    width, height = resolved(request.params.width), resolved(request.params.height)
    image = input_at_size(request)
    if request.mask is None:
        return image, np.full((height, width), 255, np.uint8)
    mask = np.asarray(Image.fromarray(request.mask).resize((width, height), Image.Resampling.NEAREST))
    return image, mask


def mask_condition(family: TaskFamily, request: GenerationRequest) -> Tensor:
    """The mask at the output size as diffusers preprocesses it, one row per image
    (n, 1, H, W), 1 = repaint."""
    params = request.params
    mask = Image.fromarray(inputs_at_size(request)[1])
    processor = family.pipe.mask_processor
    condition: Tensor = processor.preprocess([mask] * params.n, height=params.height, width=params.width)
    return condition
