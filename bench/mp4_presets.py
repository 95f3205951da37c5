"""x264's preset and threads against an MP4's encode time, bytes and PSNR, on frames like a
generated video's (soft shapes drifting over a gradient, a little noise), from a tiny model's
105 frames of 32x32 to 81 of 832x480: wall time of one `encode_mp4` (x264's threads run
beside this one), median of 5 (3 at 256² and above). The server encodes at `X264_PRESET`, in
one thread up to `ONE_THREAD_MAX_PIXELS` (`server/videos/encoding.py`).

    python -m bench.mp4_presets
"""

from __future__ import annotations

import io
import statistics
import time

import av
import numpy as np

from server.videos.encoding import encode_mp4

# (frames, height, width): a tiny model's 4 s at 25 fps, small and medium sizes, Wan's 480p.
SHAPES = ((105, 32, 32), (49, 128, 128), (49, 256, 256), (49, 512, 512), (81, 480, 832))
# (preset, threads): x264's default and the server's, each in x264's own threads (0) and one.
SETTINGS = (("medium", 0), ("medium", 1), ("veryfast", 0), ("veryfast", 1))


def scene(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """`count` RGB frames: four soft discs drifting over a colour gradient, Gaussian noise (sd 2)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    background = np.stack([x / width * 200 + 20, y / height * 180 + 30, np.full_like(x, 90)], -1)
    frames = np.empty((count, height, width, 3), np.uint8)
    for index in range(count):
        image = background.copy()
        for disc in range(4):
            cx = width * (0.2 + 0.6 * ((disc * 0.37 + index * 0.01 * (disc + 1)) % 1))
            cy = height * (0.3 + 0.4 * ((disc * 0.61 + index * 0.007) % 1))
            radius = min(height, width) * (0.08 + 0.04 * disc)
            weight = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * radius**2))[..., None]
            image = image * (1 - weight) + weight * np.array([255 - 60 * disc, 40 * disc, 200 - 30 * disc])
        frames[index] = np.clip(image + rng.normal(0, 2, image.shape), 0, 255).astype(np.uint8)
    return frames


def psnr(frames: np.ndarray, data: bytes) -> float:
    with av.open(io.BytesIO(data), mode="r") as container:
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    error = np.mean((decoded.astype(np.float64) - frames) ** 2)
    return float(10 * np.log10(255**2 / error))


def main() -> None:
    print("| frames | preset | threads | ms | bytes | PSNR dB |")
    print("|---|---|---|---:|---:|---:|")
    for count, height, width in SHAPES:
        frames = scene(count, height, width)
        for preset, threads in SETTINGS:
            times, data = [], b""
            for _ in range(5 if height < 256 else 3):
                start = time.perf_counter()
                data = encode_mp4(frames, 25, preset=preset, threads=threads)
                times.append(time.perf_counter() - start)
            print(
                f"| {count}x{width}x{height} | {preset} | {threads or 'x264'} "
                f"| {statistics.median(times) * 1000:.1f} | {len(data):,} | {psnr(frames, data):.2f} |"
            )


if __name__ == "__main__":
    main()
