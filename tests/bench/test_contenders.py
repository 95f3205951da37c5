"""The server contender's video requests against a fake Videos API (`httpx.MockTransport`):
an image-to-video request brings the picture the direct contender animates, a video counts
as had only once its MP4 is downloaded, as an image once its bytes are, and its end is
learnt soon after it comes."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from bench.contenders import ServerContender, input_image, video_poll_interval
from bench.workload import RequestSpec

SPEC = RequestSpec("a cat", 32, 32, 4, None, 1, seed=7, seconds=1.0)


class FakeVideos:
    """`POST /v1/videos`, one poll in progress then completed, and the MP4 (or `content_status`)."""

    def __init__(self, content_status: int = 200) -> None:
        self.content_status = content_status
        self.created: list[dict[str, object]] = []
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(f"{request.method} {request.url.path}")
        if request.method == "POST":
            self.created.append(json.loads(request.content))
            return httpx.Response(200, json={"id": "video_1", "status": "queued"})
        if request.url.path.endswith("/content"):
            return httpx.Response(self.content_status, content=b"mp4 bytes")
        polls = sum(path == "GET /v1/videos/video_1" for path in self.paths)
        return httpx.Response(
            200, json={"id": "video_1", "status": "in_progress" if polls < 2 else "completed"}
        )


def contender(modality: str, videos: FakeVideos) -> ServerContender:
    client = httpx.AsyncClient(base_url="http://h", transport=httpx.MockTransport(videos))
    return ServerContender("server", "http://h", modality, _client=client)


async def test_a_video_is_had_once_its_mp4_is_downloaded() -> None:
    videos = FakeVideos()
    outcome = await contender("video", videos).send(SPEC)
    assert outcome.ok and outcome.outputs == 1
    assert videos.paths[-1] == "GET /v1/videos/video_1/content"
    assert "input_reference" not in videos.created[0]  # text-to-video sends no picture


async def test_a_video_whose_mp4_cannot_be_downloaded_failed() -> None:
    outcome = await contender("video", FakeVideos(content_status=404)).send(SPEC)
    assert not outcome.ok and outcome.status == 404


@pytest.mark.parametrize("size", [(32, 32), (None, None)])
async def test_image_to_video_sends_the_picture_direct_animates(size: tuple[int | None, int | None]) -> None:
    spec = RequestSpec("a cat", size[0], size[1], 4, None, 1, seed=7, seconds=1.0)
    videos = FakeVideos()
    assert (await contender("image-to-video", videos).send(spec)).ok
    url = str(videos.created[0]["input_reference"])
    assert url.startswith("data:image/png;base64,")
    with Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))) as sent:
        np.testing.assert_array_equal(np.asarray(sent), input_image(spec))


def test_a_video_job_is_polled_at_a_twentieth_of_its_age_within_5_to_50_ms() -> None:
    """A tiny model's 70 ms video is learnt of within 5 ms, not up to 50 ms late; a long
    one's polls are no more frequent than every 50 ms."""
    assert video_poll_interval(0.0) == 0.005 and video_poll_interval(0.07) == 0.005
    assert video_poll_interval(0.4) == pytest.approx(0.02)
    assert video_poll_interval(1.0) == 0.05 and video_poll_interval(600.0) == 0.05
