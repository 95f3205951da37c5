"""Wan 2.2 A14B (two experts) through /v1/videos with the official client, step-level: two
jobs with different step counts (so different expert switches) and their own
`guidance_scale_2`, each completed with the frames it asked for."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import openai
import pytest

from bench.launch import ServerProcess, start_server, stop_server
from server.videos.encoding import probe_mp4

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def wan22_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("wan22"), "tiny-wan22", config=None)
    yield server
    stop_server(server)


def test_two_jobs_switching_experts_at_different_steps(wan22_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=wan22_server.v1, api_key="unused", max_retries=0)
    with client, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        jobs = [
            client.videos.create(
                prompt=prompt,
                seconds="1",  # type: ignore[arg-type]
                size="32x32",  # type: ignore[arg-type]
                extra_body={
                    "num_inference_steps": steps,
                    "guidance_scale": "4",
                    "guidance_scale_2": second,
                },
            )
            for prompt, steps, second in (("a boat", "3", "3"), ("a kite over the sea", "6", "1.5"))
        ]
        for job in jobs:
            video = client.videos.poll(job.id, poll_interval_ms=100)
            assert video.status == "completed", video.error
            # 1 s at Wan's 16 fps: 16 frames, rounded up to 4k+1.
            assert probe_mp4(client.videos.download_content(video.id).content) == (17, 32, 32, False)
        with pytest.raises(openai.BadRequestError) as raised:
            client.videos.create(prompt="x", extra_body={"guidance_scale_2": "nan"})
    assert raised.value.body["param"] == "guidance_scale_2"  # type: ignore[index]
