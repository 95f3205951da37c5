"""LTX-2 through /v1/videos with the official client, step-level (the default mode): jobs
with their own steps, guidance and negative prompt share the denoising steps, and each
comes back as an MP4 with the frames it asked for and its audio track."""

from __future__ import annotations

import warnings
from typing import Any

import openai
import pytest

from bench.launch import start_server, stop_server
from server.videos.encoding import probe_mp4
from tests.e2e.sharing import sent_together

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


JOBS = (
    ("rain on a tin roof", {"num_inference_steps": "3", "guidance_scale": "4"}),
    (
        "a dog barking in a park",
        {"num_inference_steps": "5", "guidance_scale": "1", "negative_prompt": "wind"},
    ),
)


def test_jobs_step_together_and_each_has_its_audio_track(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start_server(tmp_path_factory.mktemp("ltx2"), "tiny-ltx2", "--batching", "step", config=None)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        with client, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)

            def send() -> list[Any]:
                jobs = [
                    client.videos.create(
                        prompt=prompt,
                        seconds="1",  # type: ignore[arg-type]
                        size="32x32",  # type: ignore[arg-type]
                        extra_body={"fps": "8", **extra},
                    )
                    for prompt, extra in JOBS
                ]
                return [client.videos.poll(job.id, poll_interval_ms=100) for job in jobs]

            # Queued one after the other: the second joins the first's steps.
            for video in sent_together(server, send):
                assert video.status == "completed", video.error
                # 1 s at 8 fps: 8 frames, rounded up to 8k+1.
                assert probe_mp4(client.videos.download_content(video.id).content) == (9, 32, 32, True)
        # Decoded by the step-level stages (request mode has no such decodes).
        assert server.metric("diffbatch_decode_batch_size_count") >= 1
    finally:
        stop_server(server)
