"""MP4 and thumbnail encoding for generated videos (server/videos/encoding.py)."""

from __future__ import annotations

import io
import os

import av
import numpy as np
import pytest
from PIL import Image

from server.media import encode_image
from server.videos.encoding import encode_mp4, first_frame_png, probe_mp4, spritesheet_png


def _frames(count: int, height: int, width: int) -> np.ndarray:
    """Frames that differ: a bright square moving left to right over a gradient."""
    frames = np.zeros((count, height, width, 3), dtype=np.uint8)
    frames[..., 2] = np.linspace(0, 255, width, dtype=np.uint8)
    for index in range(count):
        left = index * (width - 8) // max(count - 1, 1)
        frames[index, : height // 2, left : left + 8] = 255
    return frames


def _decoded(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data), mode="r") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def test_encodes_all_frames_at_frame_size_without_audio() -> None:
    data = encode_mp4(_frames(17, 32, 48), fps=8)
    assert probe_mp4(data) == (17, 48, 32, False)


def test_odd_size_is_padded_to_even() -> None:
    frames = _frames(5, 31, 33)
    data = encode_mp4(frames, fps=8)
    assert probe_mp4(data) == (5, 34, 32, False)


def test_audio_is_muxed_as_aac() -> None:
    audio = (0.5 * np.sin(np.linspace(0, 2 * np.pi * 440, 16000))).astype(np.float32)
    data = encode_mp4(_frames(17, 32, 48), fps=16, audio=np.stack([audio, -audio]), sample_rate=16000)
    assert probe_mp4(data) == (17, 48, 32, True)
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate, stream.channels) == ("aac", 16000, 2)


def test_decoded_frames_keep_their_content() -> None:
    frames = _frames(17, 32, 48)
    decoded = _decoded(encode_mp4(frames, fps=8))
    assert len(decoded) == 17
    assert any(not np.array_equal(decoded[0], other) for other in decoded[1:])
    # Lossy, but the moving square must land where it was drawn.
    errors = [
        np.abs(got.astype(int) - want.astype(int)).mean() for got, want in zip(decoded, frames, strict=True)
    ]
    assert max(errors) < 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frames": np.zeros((2, 8, 8, 3), dtype=np.float32)}, "uint8"),
        ({"frames": np.zeros((8, 8, 3), dtype=np.uint8)}, r"\(F, H, W, 3\)"),
        ({"frames": np.zeros((2, 8, 8, 4), dtype=np.uint8)}, r"\(F, H, W, 3\)"),
        ({"frames": np.zeros((0, 8, 8, 3), dtype=np.uint8)}, "at least one"),
        ({"fps": 0}, "fps"),
        ({"audio": np.zeros((2, 100), dtype=np.float64)}, "float32"),
        ({"audio": np.zeros(100, dtype=np.float32)}, "channels"),
        ({"audio": np.zeros((3, 100), dtype=np.float32)}, "channels"),
        ({"audio": np.zeros((2, 100), dtype=np.float32), "sample_rate": 0}, "sample_rate"),
    ],
)
def test_bad_input_raises_value_error(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"frames": np.zeros((2, 8, 8, 3), dtype=np.uint8), "fps": 8}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        encode_mp4(**arguments)  # type: ignore[arg-type]


def test_thumbnail_is_first_frame_png() -> None:
    frames = _frames(3, 31, 33)
    with Image.open(io.BytesIO(first_frame_png(frames))) as image:
        assert (image.format, image.size, image.mode) == ("PNG", (33, 31), "RGB")
        assert np.array_equal(np.asarray(image), frames[0])


def test_thumbnail_and_spritesheet_are_the_servers_png() -> None:
    """Encoded as every PNG of the server (`server.media`: its zlib level, the GIL let go)."""
    frames = _frames(4, 32, 48)
    assert first_frame_png(frames) == encode_image(frames[0], "png")
    sheet = np.asarray(Image.open(io.BytesIO(spritesheet_png(frames))))
    assert spritesheet_png(frames) == encode_image(sheet, "png")


def _x264_settings(data: bytes) -> str:
    """The settings x264 writes into its stream (an SEI message: "... options: cabac=1 ...")."""
    start = data.index(b"options: ")
    return data[start : data.index(b"\x00", start)].decode()


def test_small_frames_are_encoded_fast_in_one_thread() -> None:
    # 128x128, the largest frames in one thread (x264 alone would slice them between threads).
    settings = _x264_settings(encode_mp4(_frames(3, 128, 128), fps=8)).split()
    # `veryfast` (ref=1, subme=2), not x264's default `medium` (ref=3, subme=7).
    assert "ref=1" in settings and "subme=2" in settings
    assert "threads=1" in settings


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="x264 takes one thread on one core anyway")
def test_larger_frames_keep_x264_threads() -> None:
    settings = _x264_settings(encode_mp4(_frames(3, 144, 128), fps=8)).split()
    assert "subme=2" in settings
    assert "threads=1" not in settings
