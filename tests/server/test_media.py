"""Image encoding: RGB and RGBA arrays (Qwen-Image 2.1 draws RGBA) in every output format."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from server.media import encode_image


@pytest.mark.parametrize("output_format", ["png", "jpeg", "webp"])
def test_rgba_images_encode_in_every_format_keeping_alpha_where_it_can(output_format: str) -> None:
    rgba = np.random.default_rng(0).integers(0, 256, (8, 8, 4), dtype=np.uint8)
    image = Image.open(io.BytesIO(encode_image(rgba, output_format)))
    assert image.size == (8, 8)
    assert image.mode == ("RGB" if output_format == "jpeg" else "RGBA")  # JPEG has no alpha


def _zlib_header(png: bytes) -> bytes:
    """The first two bytes of a PNG's compressed pixels (its first IDAT chunk)."""
    position = 8  # the PNG signature
    while position < len(png):
        length = int.from_bytes(png[position : position + 4], "big")
        if png[position + 4 : position + 8] == b"IDAT":
            return png[position + 8 : position + 10]
        position += 12 + length
    raise AssertionError("no IDAT chunk")


def test_png_is_compressed_at_the_fast_level_and_keeps_every_pixel() -> None:
    """Level 1 (`PNG_LEVEL`): a third of the CPU time of zlib's default for ~2% more bytes
    (docs/speed.md). zlib's header says which level family compressed the stream (FLEVEL,
    the second byte's top two bits): 0 the fastest, 2 the default that Pillow writes."""
    pixels = np.random.default_rng(1).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    png = encode_image(pixels, "png")
    assert _zlib_header(png)[1] >> 6 == 0
    assert (np.asarray(Image.open(io.BytesIO(png))) == pixels).all()
