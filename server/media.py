"""Encoding generated arrays into the image formats clients asked for: PNG through
imagecodecs (libpng over zlib-ng), JPEG and WebP through Pillow. The long encodes (PNG,
WebP) let go of the GIL while they compress, so they run on all cores beside the event loop
and the pipeline's thread (`server.encoding_pool`); a JPEG holds it for its few
milliseconds."""

from __future__ import annotations

import io
from typing import Any

import imagecodecs
import numpy as np
from PIL import Image

_PIL_FORMAT = {"jpeg": "JPEG", "webp": "WEBP"}
MEDIA_TYPE = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}

# zlib level of every PNG. Measured on a photo-like 1024x1024 image (`python -m
# bench.png_levels`, docs/benchmarks.md): level 1 takes 60 ms of CPU for 60.5% of the raw
# bytes, level 6 156 ms for 59.2% (Pillow's default, its level 6: 198 ms, 58.4%); level 0
# stores the pixels uncompressed (+65% bytes).
PNG_LEVEL = 1


def encode_image(array: Any, output_format: str, compression: int | None = None) -> bytes:
    """Encode an HxWx3 (RGB) or HxWx4 (RGBA: Qwen-Image 2.1) uint8 array; JPEG, which has no
    alpha channel, drops an RGBA image's.

    `compression` follows OpenAI's `output_compression` (0-100, default 100) and is used as
    the JPEG/WebP quality; PNG is lossless and ignores it.
    """
    pixels = np.ascontiguousarray(array, dtype=np.uint8)
    if output_format == "png":
        # Pillow holds the GIL while it compresses into memory; libpng here does not.
        return bytes(imagecodecs.png_encode(pixels, level=PNG_LEVEL))
    image = Image.fromarray(pixels)  # HxWx3 uint8 is RGB, HxWx4 RGBA
    if output_format == "jpeg" and image.mode == "RGBA":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    quality = 100 if compression is None else compression
    image.save(buffer, format=_PIL_FORMAT[output_format], quality=quality)
    return buffer.getvalue()


def image_size(array: Any) -> str:
    height, width = np.asarray(array).shape[:2]
    return f"{width}x{height}"
