"""Each tenant's webhooks are signed with its own secret: a request's own webhook_url with its
API key's `webhook_secret`, `--webhook-url` with `--webhook-secret`; which key signs is kept
with a delivery (never the secret), so a resumed one is signed the same, and one whose key
this server does not hold is given up, logged."""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
from pathlib import Path

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from server.api_keys import ApiKey
from server.jobs.model import JobStore
from server.jobs.offloop import AsyncJobStore
from server.jobs.opening import open_job_store
from server.jobs.sqlite import SQLiteJobStore
from server.metrics import Metrics
from server.videos.protocol import VideoCreateRequest
from server.videos.remix import settings_of
from server.webhooks import SERVER_SIGNER, OwnWebhook, WebhookEvent, WebhookSender, webhook_signer
from tests.polling import until
from tests.server.test_videos_api import Harness, poll
from tests.webhook_receiver import Received, webhook_receiver


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


SERVER_SECRET, TENANT_SECRET = new_secret(), new_secret()
TENANT = ApiKey("tenant-key", webhook_secret=TENANT_SECRET)
# A tenant with a secret, and one without.
KEYS = f"tenant-key:webhook_secret={TENANT_SECRET},plain-key"


def signed_by(secret: str, got: Received) -> bool:
    try:
        Webhook(secret).verify(got.body, got.headers)
    except WebhookVerificationError:
        return False
    return True


async def test_a_tenants_own_webhook_is_signed_with_its_keys_secret(tmp_path: Path) -> None:
    with webhook_receiver() as server_hook, webhook_receiver() as own_hook:
        settings = {
            "api_key": KEYS,
            "webhook_url": server_hook.url,
            "webhook_secret": SERVER_SECRET,
            "allowed_webhook_hosts": "127.0.0.1",
        }
        async with Harness(tmp_path, None, **settings) as client:
            client.headers["authorization"] = "Bearer tenant-key"
            body = {"prompt": "a boat", "seconds": 1, "webhook_url": own_hook.url}
            created = (await client.post("/v1/videos", json=body)).json()
            await poll(client, created["id"], {"completed"})
            await until(lambda: len(server_hook.received) == len(own_hook.received) == 1, "both told")
    [own], [operator] = own_hook.received, server_hook.received
    assert signed_by(TENANT_SECRET, own) and not signed_by(SERVER_SECRET, own)
    assert signed_by(SERVER_SECRET, operator) and not signed_by(TENANT_SECRET, operator)
    assert json.loads(own.body)["data"] == {"id": created["id"]}


async def test_a_key_without_a_webhook_secret_cannot_name_a_webhook_url(tmp_path: Path) -> None:
    settings = {"api_key": KEYS, "webhook_secret": SERVER_SECRET, "allowed_webhook_hosts": "127.0.0.1"}
    async with Harness(tmp_path, None, **settings) as client:
        body = {"prompt": "a boat", "seconds": 1, "webhook_url": "http://127.0.0.1:9/hooks"}
        answer = await client.post("/v1/videos", json=body, headers={"authorization": "Bearer plain-key"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "webhook_url" and "webhook_secret" in error["message"]


def sqlite_store(directory: Path, owner: str) -> JobStore:
    return open_job_store(None, directory / "videos.sqlite3", 60, lease_s=60, owner=owner)


async def test_a_tenants_delivery_resumed_by_another_server_is_signed_with_its_keys_secret(
    tmp_path: Path,
) -> None:
    stores = [await AsyncJobStore.open(functools.partial(sqlite_store, tmp_path, o), 5) for o in "ab"]
    secrets = {SERVER_SIGNER: SERVER_SECRET, webhook_signer(TENANT.tenant()): TENANT_SECRET}
    event = WebhookEvent.for_video("video.completed", "video_1")
    first = Metrics()
    with webhook_receiver(503) as receiver:
        a = WebhookSender(secrets, first, attempts=3, backoff_s=3600, journal=stores[0])
        a.send(receiver.url, event, webhook_signer(TENANT.tenant()))
        await until(lambda: len(receiver.received) == 1, "the first attempt refused")
        await a.close(grace_s=0)  # stopped while waiting an hour to retry
        b = WebhookSender(secrets, Metrics(), attempts=3, backoff_s=0.01, journal=stores[1])
        assert await b.resume_abandoned() == 1
        await until(lambda: len(receiver.received) == 2, "delivered by the next server")
        await b.close()
    assert all(signed_by(TENANT_SECRET, got) for got in receiver.received)
    assert not signed_by(SERVER_SECRET, receiver.received[1])
    for store in stores:
        await store.close()


async def test_a_delivery_whose_signer_this_server_does_not_hold_is_given_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key since removed from this server's keys (or held only by another server sharing
    the store): nothing here may sign it, and no other secret does."""
    unknown = webhook_signer(TENANT.tenant())
    metrics = Metrics()
    with webhook_receiver() as receiver:
        before = open_job_store(None, tmp_path / "videos.sqlite3", 60, lease_s=60, owner="before")
        before.add_delivery(WebhookEvent.for_video("video.failed", "video_1").pending(receiver.url, unknown))
        before.close()
        store = await AsyncJobStore.open(
            lambda: open_job_store(None, tmp_path / "videos.sqlite3", 60, lease_s=60, owner="after"), 5
        )
        sender = WebhookSender({SERVER_SIGNER: SERVER_SECRET}, metrics, journal=store)
        with caplog.at_level(logging.WARNING, logger="server.webhooks"):
            assert await sender.resume_abandoned() == 1
            dropped = "diffbatch_webhook_events_dropped_total"
            await until(
                lambda: metrics.registry.get_sample_value(dropped, {"event": "video.failed"}) == 1, "gone"
            )
        await sender.close()
    assert receiver.received == []
    assert any(unknown in r.getMessage() and "given up" in r.getMessage() for r in caplog.records)
    assert await store.keep_deliveries() == []  # ended, not left to bounce between servers
    await store.close()


async def test_a_dead_servers_job_is_announced_signed_with_its_tenants_secret(tmp_path: Path) -> None:
    with webhook_receiver() as own_hook:
        settings = {"api_key": KEYS, "allowed_webhook_hosts": "127.0.0.1"}  # no server secret at all
        harness = Harness(tmp_path, None, **settings)
        async with harness:
            service = harness.app.state.diffbatch.video_service()
            # A job of another server on the same table, whose lease has run out (it died),
            # its settings as that server kept them.
            dead = SQLiteJobStore(tmp_path / "videos" / "videos.sqlite3", 3600, owner="dead", lease_s=-1)
            body = VideoCreateRequest.model_validate(
                {"prompt": "p", "seconds": 1, "webhook_url": own_hook.url}
            )
            own = OwnWebhook(own_hook.url, webhook_signer(TENANT.tenant()))
            job = dead.create(
                model="m",
                prompt="p",
                seconds="1",
                size="32x32",
                settings=settings_of(body, 1, False, False, own),
            )
            dead.close()
            await service._leases.renew_once()
            await until(lambda: len(own_hook.received) == 1, "the tenant told")
    [got] = own_hook.received
    assert signed_by(TENANT_SECRET, got) and json.loads(got.body)["data"] == {"id": job.id}
