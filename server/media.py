"""Encoding generated arrays into the image formats clients asked for (Pillow)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
MEDIA_TYPE = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(array: Any, output_format: str, compression: int | None = None) -> bytes:
    """Encode an HxWx3 (RGB) or HxWx4 (RGBA: Qwen-Image 2.1) uint8 array; JPEG, which has no
    alpha channel, drops an RGBA image's.

    `compression` follows OpenAI's `output_compression` (0-100, default 100) and is used as
    the JPEG/WebP quality; PNG is lossless and ignores it.
    """
    image = Image.fromarray(np.asarray(array, dtype=np.uint8))  # HxWx3 uint8 is RGB, HxWx4 RGBA
    if output_format == "jpeg" and image.mode == "RGBA":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    options: dict[str, Any] = {}
    if output_format in ("jpeg", "webp"):
        options["quality"] = 100 if compression is None else compression
    image.save(buffer, format=_PIL_FORMAT[output_format], **options)
    return buffer.getvalue()


def image_size(array: Any) -> str:
    height, width = np.asarray(array).shape[:2]
    return f"{width}x{height}"
