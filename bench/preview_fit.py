"""What the linear preview's fit costs per observed decode: `LinearPreview.observe` on one
decode of 8 images at several sizes, best of 7, in this process (no model, random data).

    python -m bench.preview_fit
    PYTHONPATH=/path/to/other/checkout python bench/preview_fit.py   # another version's
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pipelines.stepping.preview import LinearPreview

# (image side, latent channels, VAE downscale): tiny Qwen-Image's, then real-model sizes.
CASES = ((64, 16, 2), (512, 16, 8), (1024, 16, 8))


def main() -> None:
    torch.set_num_threads(1)
    for side, channels, scale in CASES:
        grid = torch.randn(8, channels, side // scale, side // scale)
        images = np.random.default_rng(0).random((8, side, side, 3), dtype=np.float32)
        preview, times = LinearPreview(), []
        for _ in range(7):
            start = time.perf_counter()
            preview.observe(grid, images)
            times.append(time.perf_counter() - start)
        print(f"8 images {side}x{side}: observe {min(times) * 1000:.1f} ms (best of 7, 1 thread)")


if __name__ == "__main__":
    main()
