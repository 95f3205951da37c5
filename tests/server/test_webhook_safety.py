"""Webhooks that cannot be turned against the server: URLs read as httpx reads them (at the
request, at start, and for rows stored before), any failure of an attempt counted and
retried (no delivery task dies), a deadline on the whole attempt, answers' bodies never
read, a few connections per host, and no secret of a URL in the logs."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path

import httpx
import pytest

from server.jobs.model import PendingDelivery
from server.jobs.sqlite import SQLiteJobStore
from server.metrics import Metrics
from server.settings import ServeSettings
from server.webhook_urls import redacted_url
from server.webhooks import PER_RECEIVER, SERVER_SIGNER, WebhookEvent, WebhookSender
from tests.polling import until
from tests.server.counters import labelled_count
from tests.server.test_videos_api import Harness
from tests.webhook_receiver import HUGE, hang, huge_body, raw_receiver, trickle, webhook_receiver

SECRET = "whsec_" + base64.b64encode(b"a test secret of 24 bytes").decode()
SECRETS = {SERVER_SIGNER: SECRET}
# Only a guard against a hang: a delivery that works ends at once, however slow the machine.
GUARD_S = 30.0
# URLs that `urlsplit` reads as host 127.0.0.1 (or hooks.example.com) and httpx refuses to
# send to (or, the port, fails on when connecting).
REFUSED_URLS = [
    "http://127.0.0.1\t/hooks",
    "http://127.0.0.1/hooks\n",
    "http://127.0.0.1\n.evil.example/hooks",
    "http://hooks.example.com:80:81/hooks",
    "http://127.0.0.1:99999/hooks",
]


def webhook_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "server.webhooks"]


@pytest.mark.parametrize("url", REFUSED_URLS)
async def test_a_webhook_url_httpx_would_refuse_is_a_400_naming_it(tmp_path: Path, url: str) -> None:
    settings = {"allowed_webhook_hosts": "127.0.0.1,hooks.example.com", "webhook_secret": SECRET}
    async with Harness(tmp_path, None, **settings) as client:
        answer = await client.post("/v1/videos", json={"prompt": "a boat", "seconds": 1, "webhook_url": url})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "webhook_url"


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_a_webhook_url_flag_httpx_would_refuse_stops_the_start(url: str) -> None:
    with pytest.raises(ValueError, match="webhook_url"):
        ServeSettings.model_validate({"webhook_url": url, "webhook_secret": SECRET})


async def test_a_delivery_stored_with_a_bad_url_is_given_up_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A row from before URLs were checked as httpx reads them: the restarted server gives
    it up (logged, counted) instead of dying on it at every start."""
    (tmp_path / "videos").mkdir(parents=True)
    before = SQLiteJobStore(tmp_path / "videos" / "videos.sqlite3", 3600, owner="before", lease_s=60)
    before.add_delivery(PendingDelivery("evt_1", "http://127.0.0.1\t/hooks", "video.completed", 1, "video_1"))
    before.close()
    harness = Harness(tmp_path, None, webhook_secret=SECRET)
    with caplog.at_level(logging.INFO, logger="server.webhooks"):
        async with harness:
            metrics = harness.app.state.diffbatch.metrics
            await until(
                lambda: (
                    labelled_count(metrics, "diffbatch_webhook_events_dropped_total", event="video.completed")
                    == 1
                ),
                "the delivery given up",
            )
    assert any("given up without an attempt" in m and "\\t" in m for m in webhook_messages(caplog))
    after = SQLiteJobStore(tmp_path / "videos" / "videos.sqlite3", 3600, owner="after", lease_s=60)
    assert after.keep_deliveries() == []  # ended: no server takes it up again
    after.close()


async def test_any_failure_of_an_attempt_is_a_failed_attempt_named_by_its_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not only httpx's errors: whatever an attempt raises is counted and retried, and the
    log names the exception's type when its text is empty."""

    def fail(request: httpx.Request) -> httpx.Response:
        raise RuntimeError()

    metrics = Metrics()
    sender = WebhookSender(SECRETS, metrics, attempts=2, backoff_s=0.01)
    sender._client = httpx.AsyncClient(transport=httpx.MockTransport(fail))
    with caplog.at_level(logging.INFO, logger="server.webhooks"):
        delivered = await asyncio.wait_for(
            sender.send("http://hooks.example.com/x", WebhookEvent.for_video("video.failed", "video_1")),
            GUARD_S,
        )
    await sender.close()
    assert not delivered
    assert (
        labelled_count(metrics, "diffbatch_webhook_attempts_total", event="video.failed", outcome="error")
        == 2
    )
    assert sum(m.endswith(": RuntimeError") for m in webhook_messages(caplog)) == 2


async def test_a_receiver_that_never_answers_is_logged_by_the_exception_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A timeout's exception has no text: the log line names its type."""
    async with raw_receiver(hang) as receiver:
        sender = WebhookSender(SECRETS, Metrics(), attempts=1, timeout_s=0.2)
        with caplog.at_level(logging.INFO, logger="server.webhooks"):
            event = WebhookEvent.for_video("video.completed", "video_1")
            assert not await asyncio.wait_for(sender.send(receiver.url, event), GUARD_S)
        await sender.close()
    [failed] = [m for m in webhook_messages(caplog) if "gave up" not in m]  # the attempt's line
    assert "Timeout" in failed, failed


async def test_a_trickling_receiver_is_cut_at_the_attempt_deadline() -> None:
    """A byte every 50 ms never trips a read timeout; the attempt's deadline ends it."""
    metrics = Metrics()
    async with raw_receiver(trickle) as receiver:
        sender = WebhookSender(SECRETS, metrics, attempts=1, timeout_s=0.5)
        event = WebhookEvent.for_video("video.completed", "video_1")
        assert not await asyncio.wait_for(sender.send(receiver.url, event), GUARD_S)
        await sender.close()
    assert (
        labelled_count(metrics, "diffbatch_webhook_attempts_total", event="video.completed", outcome="error")
        == 1
    )


async def test_an_answers_body_is_not_read() -> None:
    """A 200 with a 64 MiB body is a delivery; the sender reads its status, not its body
    (the receiver's writes stop once socket buffers fill and the sender has closed)."""
    async with raw_receiver(huge_body) as receiver:
        sender = WebhookSender(SECRETS, Metrics(), attempts=1)
        event = WebhookEvent.for_video("video.completed", "video_1")
        assert await asyncio.wait_for(sender.send(receiver.url, event), GUARD_S)
        await until(lambda: receiver.ended == 1, "the receiver stopped sending", GUARD_S)
        await sender.close()
    assert receiver.body_sent < HUGE / 2


async def test_hanging_receivers_hold_a_few_connections_and_others_are_delivered() -> None:
    metrics = Metrics()
    async with raw_receiver(hang) as hanging:
        sender = WebhookSender(SECRETS, metrics, attempts=1, timeout_s=3600)
        stuck = [
            sender.send(hanging.url, WebhookEvent.for_video("video.completed", f"video_{n}"))
            for n in range(PER_RECEIVER + 4)
        ]
        await until(
            lambda: hanging.connections >= PER_RECEIVER, "the hanging receiver's share taken", GUARD_S
        )
        with webhook_receiver() as healthy:
            event = WebhookEvent.for_video("video.completed", "video_ok")
            assert await asyncio.wait_for(sender.send(healthy.url, event), GUARD_S)
        assert hanging.connections == PER_RECEIVER  # the others wait their turn, not a connection
        assert not any(task.done() for task in stuck)
        await sender.close(grace_s=0)


async def test_user_info_and_query_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    sender = WebhookSender(SECRETS, metrics, attempts=2, backoff_s=0.01)
    with caplog.at_level(logging.INFO, logger="server.webhooks"), webhook_receiver(503) as receiver:
        secret_url = receiver.url.replace("http://", "http://user:hunter2@") + "?token=t0ps3cret"
        event = WebhookEvent.for_video("video.completed", "video_1")
        assert await sender.send(secret_url, event)  # refused once, then delivered
        with webhook_receiver() as gone:
            gone_url = gone.url.replace("http://", "http://user:hunter2@") + "?token=t0ps3cret"
        assert not await sender.send(gone_url, event)  # refused connections: given up
    await sender.close()
    messages = webhook_messages(caplog)
    assert any("answered 503" in m for m in messages) and any("gave up" in m for m in messages)
    assert not any("hunter2" in m or "t0ps3cret" in m for m in messages), messages
    assert receiver.received[-1].headers["Authorization"].startswith("Basic ")  # still sent


def test_a_url_httpx_cannot_read_is_redacted_too() -> None:
    shown = redacted_url("http://user:hunter2@host:80:81/x\n?token=t0ps3cret")
    assert "hunter2" not in shown and "t0ps3cret" not in shown and "\n" not in shown
    assert shown == "http://***@host:80:81/x\\n"
