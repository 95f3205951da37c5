"""Small images for tests: solid PNG uploads and reproducible random pictures."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 10, 10), mode: str = "RGB") -> bytes:
    """A solid PNG (a mask, all white, with mode "L")."""
    buffer = io.BytesIO()
    Image.new(mode, (width, height), colour if mode == "RGB" else 255).save(buffer, format="PNG")
    return buffer.getvalue()


def picture(width: int, height: int, seed: int) -> np.ndarray:
    """Random uint8 HxWx3 pixels, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
