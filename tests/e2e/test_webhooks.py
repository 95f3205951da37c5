"""A real `diffbatch serve tiny-wan` with `--webhook-url` (the secret from the environment,
as a deployment sets it): a receiver on loopback gets `video.completed` for a video made
through the official client, and verifies it with the Standard Webhooks library."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import openai
import pytest
from standardwebhooks import Webhook

from bench.launch import start_server, stop_server
from tests.polling import wait_for
from tests.webhook_receiver import webhook_receiver

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_a_served_video_is_announced_by_a_signed_webhook(tmp_path: Path) -> None:
    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    with webhook_receiver(503) as receiver:  # the first attempt is refused
        server = start_server(
            tmp_path,
            "tiny-wan",
            "--batching",
            "request",
            "--webhook-url",
            receiver.url,
            "--webhook-backoff-s",
            "0.1",
            config=None,
            env={"DIFFBATCH_WEBHOOK_SECRET": secret},
        )
        try:
            with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
                video = client.videos.create_and_poll(
                    prompt="a paper boat",
                    seconds="1",  # type: ignore[arg-type]
                    poll_interval_ms=100,
                )
            wait_for(lambda: len(receiver.received) == 2, "the event delivered on its second attempt")
            attempts = server.metric(
                'diffbatch_webhook_attempts_total{event="video.completed",outcome="refused"}'
            )
        finally:
            stop_server(server)
    first, second = receiver.received
    event = Webhook(secret).verify(second.body, second.headers)
    assert event["type"] == "video.completed" and event["data"] == {"id": video.id}
    assert first.headers["webhook-id"] == second.headers["webhook-id"] and json.loads(first.body) == event
    assert attempts == 1
