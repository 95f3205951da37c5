"""Wan VACE through /v1/videos: a control video, its mask and reference images as multipart
parts (the official client has no place for them: httpx), a reference as OpenAI's
`input_reference` (the official client), the jobs polled and downloaded with the client,
and bad inputs answered 400 naming the field."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from bench.launch import ServerProcess, start_server, stop_server
from server.videos.encoding import encode_mp4, probe_mp4
from tests.doc_pages import run_command_line
from tests.e2e.test_readme import curl_commands, is_controlled_video
from tests.media import png

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# 1 s at Wan's 16 fps: 16 frames, rounded up to 4k+1.
FRAMES = 17


@pytest.fixture(scope="module")
def vace_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("vace"), "tiny-wan-vace", config=None)
    yield server
    stop_server(server)


def control_video(frames: int = FRAMES) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (frames, 32, 48, 3), dtype=np.uint8)
    return encode_mp4(pixels, 16)


def create(server: ServerProcess, files: list[tuple[str, tuple[str, bytes, str]]]) -> httpx.Response:
    data = {"prompt": "a dancer", "seconds": "1", "num_inference_steps": "2", "conditioning_scale": "0.8"}
    return httpx.post(f"{server.v1}/videos", data=data, files=files, timeout=60)


def test_a_controlled_video_and_a_referenced_one(vace_server: ServerProcess) -> None:
    controlled = create(
        vace_server,
        [
            ("video", ("control.mp4", control_video(), "video/mp4")),
            ("mask", ("mask.png", png(48, 32, mode="L"), "image/png")),
            ("reference_images[]", ("face.png", png(40, 24), "image/png")),
            ("reference_images[]", ("room.png", png(24, 40, (10, 200, 10)), "image/png")),
        ],
    )
    assert controlled.status_code == 200, controlled.text
    assert controlled.json()["size"] == "48x32"  # the control video's
    client = openai.OpenAI(base_url=vace_server.v1, api_key="unused", max_retries=0)
    with client, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        referenced = client.videos.create(
            prompt="a dancer",
            input_reference=("face.png", png(40, 40), "image/png"),
            seconds="1",  # type: ignore[arg-type]
            size="32x32",  # type: ignore[arg-type]
            extra_body={"num_inference_steps": "3", "guidance_scale": "4"},
        )
        for job_id, width in ((controlled.json()["id"], 48), (referenced.id, 32)):
            video = client.videos.poll(job_id, poll_interval_ms=100)
            assert video.status == "completed", video.error
            assert probe_mp4(client.videos.download_content(video.id).content) == (FRAMES, width, 32, False)
        with pytest.raises(openai.BadRequestError) as raised:
            client.videos.remix(controlled.json()["id"], prompt="another dancer")
    assert raised.value.body["param"] == "video_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("files", "param"),
    [
        (
            [("reference_images[]", (f"{i}.png", png(16, 16), "image/png")) for i in range(4)],
            "reference_images",
        ),
        ([("video", ("short.mp4", control_video(9), "video/mp4"))], "video"),
        ([("video", ("not.mp4", png(8, 8), "video/mp4"))], "video"),
        ([("mask", ("mask.png", png(32, 32, mode="L"), "image/png"))], "mask"),
    ],
    ids=["too-many-references", "wrong-frame-count", "not-a-video", "mask-without-video"],
)
def test_bad_inputs_are_a_400_naming_the_field(
    vace_server: ServerProcess, files: list[tuple[str, tuple[str, bytes, str]]], param: str
) -> None:
    answer = create(vace_server, files)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_the_readmes_control_video_line_works(vace_server: ServerProcess, tmp_path: Path) -> None:
    """With a pose.mp4 of 17 frames, a mask.png and a face.png in the working directory."""
    (tmp_path / "pose.mp4").write_bytes(control_video())
    (tmp_path / "mask.png").write_bytes(png(48, 32, mode="L"))
    (tmp_path / "face.png").write_bytes(png(40, 24))
    lines = [c for c in curl_commands() if is_controlled_video(c)]
    assert lines
    for command in lines:
        body = json.loads(run_command_line(command, vace_server.url, tmp_path))
        assert body.get("error") is None and body["size"] == "48x32", body
