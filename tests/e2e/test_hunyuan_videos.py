"""HunyuanVideo 1.5 through /v1/videos with the official client: text-to-video step-level (a
prompt with quoted text, read by its glyph encoder too), and image-to-video, its size the
input image's bucket."""

from __future__ import annotations

import warnings
from pathlib import Path

import openai
import pytest

from bench.launch import start_server, stop_server
from server.videos.encoding import probe_mp4
from tests.media import png

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_text_to_video_step_level(tmp_path: Path) -> None:
    server = start_server(tmp_path, "tiny-hunyuan-video15", config=None)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        with client, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create_and_poll(
                prompt='a shop sign that reads "OPEN"',
                seconds="1",  # type: ignore[arg-type]
                size="32x32",  # type: ignore[arg-type]
                poll_interval_ms=100,
                extra_body={"fps": "8", "num_inference_steps": "2", "negative_prompt": "blurry"},
            )
            assert video.status == "completed", video.error
            # 1 s at 8 fps: 8 frames, rounded up to 4k+1.
            assert probe_mp4(client.videos.download_content(video.id).content) == (9, 32, 32, False)
    finally:
        stop_server(server)


def test_image_to_video_takes_its_size_from_the_image(tmp_path: Path) -> None:
    server = start_server(tmp_path, "tiny-hunyuan-video15-i2v", config=None)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        with client, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create_and_poll(
                prompt="the flower opens",
                input_reference=("first.png", png(40, 40), "image/png"),
                seconds="1",  # type: ignore[arg-type]
                poll_interval_ms=100,
                extra_body={"fps": "8", "num_inference_steps": "2"},
            )
            assert video.status == "completed", video.error
            # A square image: the tiny model's 32x32 bucket.
            assert probe_mp4(client.videos.download_content(video.id).content) == (9, 32, 32, False)
    finally:
        stop_server(server)
