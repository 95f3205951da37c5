"""PNG's zlib level against bytes and CPU time, Pillow beside imagecodecs (what the server
uses, `server.media`), on `bench.front_end.photo` at 1024² and 512²: CPU time of one encode
of this thread (`time.thread_time`, so other work on the machine does not count), best of 5.

    python -m bench.png_levels
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from functools import partial

import imagecodecs
import numpy as np
from PIL import Image

from bench.front_end import photo


def _pillow(pixels: np.ndarray, level: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=level)
    return buffer.getvalue()


def _imagecodecs(pixels: np.ndarray, level: int) -> bytes:
    return bytes(imagecodecs.png_encode(pixels, level=level))


def _best_ms(encode: Callable[[], bytes], repeats: int = 5) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(repeats):
        start = time.thread_time()
        size = len(encode())
        times.append(time.thread_time() - start)
    return min(times) * 1000, size


def main() -> None:
    print("| size | level | Pillow ms | Pillow MB | imagecodecs ms | imagecodecs MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for side in (1024, 512):
        pixels = photo(side, side)
        for level in range(10):
            pil_ms, pil_bytes = _best_ms(partial(_pillow, pixels, level))
            codecs_ms, codecs_bytes = _best_ms(partial(_imagecodecs, pixels, level))
            raw = pixels.nbytes
            print(
                f"| {side}² | {level} | {pil_ms:.0f} | {pil_bytes / 1e6:.2f} ({pil_bytes / raw:.1%}) "
                f"| {codecs_ms:.0f} | {codecs_bytes / 1e6:.2f} ({codecs_bytes / raw:.1%}) |"
            )


if __name__ == "__main__":
    main()
