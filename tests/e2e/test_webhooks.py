"""A real `diffbatch serve tiny-wan` with `--webhook-url` (the secret from the environment,
as a deployment sets it) and a keys file whose key has its own webhook_secret: receivers on
loopback get `video.completed` for a video made through the official client, the server's
signed with the server's secret and the request's own webhook_url with the key's, each
verified with the Standard Webhooks library."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import httpx
import openai
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from bench.launch import start_server, stop_server
from tests.polling import wait_for
from tests.webhook_receiver import webhook_receiver

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


def test_a_served_video_is_announced_by_webhooks_each_signed_by_its_own_secret(tmp_path: Path) -> None:
    secret, tenant_secret = new_secret(), new_secret()
    keys = tmp_path / "keys"
    keys.write_text(f"tenant-key:webhook_secret={tenant_secret}\n")
    # The server's receiver refuses the first attempt.
    with webhook_receiver(503) as receiver, webhook_receiver() as own:
        server = start_server(
            tmp_path,
            "tiny-wan",
            "--batching",
            "request",
            "--webhook-url",
            receiver.url,
            "--webhook-backoff-s",
            "0.1",
            "--api-key-file",
            str(keys),
            "--allowed-webhook-hosts",
            "127.0.0.1",
            config=None,
            env={"DIFFBATCH_WEBHOOK_SECRET": secret},
        )
        try:
            with openai.OpenAI(base_url=server.v1, api_key="tenant-key", max_retries=0) as client:
                video = client.videos.create_and_poll(
                    prompt="a paper boat",
                    seconds="1",  # type: ignore[arg-type]
                    poll_interval_ms=100,
                    extra_body={"webhook_url": own.url},
                )
            wait_for(lambda: len(receiver.received) == 2, "the event delivered on its second attempt")
            wait_for(lambda: len(own.received) == 1, "the request's own webhook told")
            metrics = httpx.get(f"{server.url}/metrics", headers={"authorization": "Bearer tenant-key"}).text
        finally:
            stop_server(server)
    first, second = receiver.received
    event = Webhook(secret).verify(second.body, second.headers)
    assert event["type"] == "video.completed" and event["data"] == {"id": video.id}
    assert first.headers["webhook-id"] == second.headers["webhook-id"] and json.loads(first.body) == event
    assert 'diffbatch_webhook_attempts_total{event="video.completed",outcome="refused"} 1.0' in metrics
    [mine] = own.received
    assert Webhook(tenant_secret).verify(mine.body, mine.headers)["data"] == {"id": video.id}
    with pytest.raises(WebhookVerificationError):  # the server's secret does not sign a tenant's
        Webhook(secret).verify(mine.body, mine.headers)
