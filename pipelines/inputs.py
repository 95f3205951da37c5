"""Input images, reduced to what a model needs of them before they wait in the queue."""

from __future__ import annotations

import numpy as np
from PIL import Image


def reduce_image(image: np.ndarray, width: int, height: int, *, min_side: int = 0) -> np.ndarray:
    """`image` (uint8 HxWx3) scaled down, aspect kept, so that it still covers `width` x
    `height` and its short side stays at least `min_side`; the same array when it is not
    larger than that. Lanczos, as diffusers' image processors resize."""
    rows, cols = image.shape[:2]
    scale = max(width / cols, height / rows, min_side / min(rows, cols))
    if scale >= 1:
        return image
    size = (max(1, round(cols * scale)), max(1, round(rows * scale)))
    return np.asarray(Image.fromarray(image).resize(size, resample=Image.Resampling.LANCZOS))
