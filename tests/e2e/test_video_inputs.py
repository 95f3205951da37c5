"""Image-to-video (input_reference) and video with sound (LTX-2) through /v1/videos."""

from __future__ import annotations

import warnings
from pathlib import Path

import openai
import pytest

from bench.launch import start_server, stop_server
from server.video import probe_mp4
from tests.media import png

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_image_to_video_with_input_reference(tmp_path: Path) -> None:
    server = start_server(tmp_path, "tiny-wan-i2v", config=None)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create_and_poll(
                prompt="the flower opens",
                input_reference=("first.png", png(40, 40), "image/png"),
                seconds="4",
                size="32x32",  # type: ignore[arg-type]
                poll_interval_ms=100,
                extra_body={"fps": "4", "num_inference_steps": "2"},
            )
            assert video.status == "completed", video.error
            assert probe_mp4(client.videos.download_content(video.id).content) == (17, 32, 32, False)
            with pytest.raises(openai.BadRequestError) as raised:
                client.videos.create(prompt="no image for an image-to-video model")
        assert raised.value.body["param"] == "input_reference"  # type: ignore[index]
    finally:
        stop_server(server)


def test_ltx2_video_has_an_audio_track(tmp_path: Path) -> None:
    server = start_server(tmp_path, "tiny-ltx2", config=None)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create_and_poll(
                prompt="rain on a tin roof",
                seconds="4",
                size="32x32",  # type: ignore[arg-type]
                poll_interval_ms=100,
                extra_body={"fps": "8", "num_inference_steps": "2"},
            )
            assert video.status == "completed", video.error
            frames, width, height, has_audio = probe_mp4(client.videos.download_content(video.id).content)
        assert (frames, width, height, has_audio) == (33, 32, 32, True)
    finally:
        stop_server(server)
