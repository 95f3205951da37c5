"""Encoding generated video frames (and optional audio) into MP4 files clients download (PyAV).

Every function works on its own in-memory container, so they are safe to call from several
worker threads at once (e.g. via `asyncio.to_thread`).
"""

from __future__ import annotations

import io
import math
from fractions import Fraction

import av
import numpy as np

from server.media import encode_image

MEDIA_TYPE = "video/mp4"
_AUDIO_LAYOUTS = {1: "mono", 2: "stereo"}
# x264's preset. Measured (`python -m bench.mp4_presets`, docs/benchmarks.md "The MP4's
# encoder") at x264's default quality (CRF 23) against its default `medium`: `veryfast` takes
# 0.4-0.7 of the time, from 105 frames of 32x32 to 81 of 832x480, for 1-11% fewer bytes and a
# PSNR 0.1 dB lower from 512x512 up (up to 1.6 dB on a tiny model's 32x32).
X264_PRESET = "veryfast"
# Frames of at most this many pixels are encoded in one thread: there threads cost more than
# they save (105 frames of 32x32: 5.7 ms in one, 8.8 ms left to x264 and PyAV's default).
ONE_THREAD_MAX_PIXELS = 128 * 128


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValueError(f"frames must be a uint8 numpy array, got {getattr(frames, 'dtype', type(frames))}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (F, H, W, 3), got {frames.shape}")
    if frames.shape[0] == 0 or frames.shape[1] == 0 or frames.shape[2] == 0:
        raise ValueError(f"frames must hold at least one non-empty frame, got shape {frames.shape}")


def encode_mp4(
    frames: np.ndarray,
    fps: int,
    audio: np.ndarray | None = None,
    sample_rate: int = 16000,
    *,
    preset: str = X264_PRESET,
    threads: int | None = None,
) -> bytes:
    """Encode uint8 (F, H, W, 3) RGB frames as an H.264 (yuv420p) MP4, in memory.

    `preset` and `threads` are x264's (`threads` None: one for small frames, else x264's
    own choice, 0); other values are for `bench.mp4_presets`.

    yuv420p needs an even width and height: an odd dimension is padded by repeating the last
    row/column (never cropped), so the video may be one pixel larger than the frames.
    `audio`, if given, is float32 (channels, samples) in [-1, 1] with 1 or 2 channels (e.g.
    LTX-2's stereo 16 kHz track) and is muxed into the same file as AAC.
    """
    _check_frames(frames)
    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise ValueError(f"fps must be an integer >= 1, got {fps!r}")
    if audio is not None:
        if not isinstance(audio, np.ndarray) or audio.dtype != np.float32:
            raise ValueError(
                f"audio must be a float32 numpy array, got {getattr(audio, 'dtype', type(audio))}"
            )
        if audio.ndim != 2 or audio.shape[0] not in _AUDIO_LAYOUTS or audio.shape[1] == 0:
            raise ValueError(
                f"audio must have shape (channels, samples) with 1 or 2 channels, got {audio.shape}"
            )
        if sample_rate < 1:
            raise ValueError(f"sample_rate must be >= 1, got {sample_rate}")

    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        frames = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")

    buffer = io.BytesIO()
    # No movflags=+faststart: on close ffmpeg reopens the output by URL to move the moov atom,
    # which an in-memory buffer has not ("No such file or directory: '<none>'").
    with av.open(buffer, mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps, options={"preset": preset})
        video.width, video.height = frames.shape[2], frames.shape[1]
        if threads is None:
            threads = 1 if video.width * video.height <= ONE_THREAD_MAX_PIXELS else 0
        video.thread_count = threads
        video.pix_fmt = "yuv420p"
        video.time_base = Fraction(1, fps)
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=sample_rate, layout=_AUDIO_LAYOUTS[audio.shape[0]])
            sound.time_base = Fraction(1, sample_rate)
        for index, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")
            frame.pts = index
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if sound is not None and audio is not None:
            samples = np.ascontiguousarray(np.clip(audio, -1.0, 1.0))
            chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout=_AUDIO_LAYOUTS[audio.shape[0]])
            chunk.sample_rate = sample_rate
            chunk.pts = 0
            container.mux(sound.encode(chunk))
            container.mux(sound.encode(None))
    return buffer.getvalue()


def first_frame_png(frames: np.ndarray) -> bytes:
    """PNG of frame 0, for the `variant=thumbnail` download."""
    _check_frames(frames)
    return encode_image(frames[0], "png")


# Frames in a spritesheet: a 4 x 4 grid at most, evenly spaced through the video.
SPRITESHEET_FRAMES = 16


def spritesheet_png(frames: np.ndarray, max_frames: int = SPRITESHEET_FRAMES) -> bytes:
    """PNG of up to `max_frames` evenly spaced frames (first and last included) in a grid,
    row by row, `ceil(sqrt(k))` columns, for the `variant=spritesheet` download: a video at
    W x H gives a sheet of 4W x 4H (fewer for videos of fewer frames)."""
    _check_frames(frames)
    count = min(max_frames, len(frames))
    picked = frames[np.linspace(0, len(frames) - 1, count).round().astype(int)]
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    height, width = frames.shape[1:3]
    sheet = np.zeros((rows * height, columns * width, 3), np.uint8)
    for i, frame in enumerate(picked):
        row, column = divmod(i, columns)
        sheet[row * height : (row + 1) * height, column * width : (column + 1) * width] = frame
    # The server's PNG encoder (`server.media`): a 4 x 4 sheet of 832x480 frames took Pillow's
    # default 5.6 s, on the way to the job's end; it takes 0.7 s.
    return encode_image(sheet, "png")


def probe_mp4(data: bytes) -> tuple[int, int, int, bool]:
    """Decode an MP4 and return (frame_count, width, height, has_audio)."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        count = sum(1 for _ in container.decode(stream))
        return count, stream.codec_context.width, stream.codec_context.height, bool(container.streams.audio)
