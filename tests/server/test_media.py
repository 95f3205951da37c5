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
