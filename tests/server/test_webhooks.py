"""Webhooks: events signed per Standard Webhooks and verified with its library by a receiver
on loopback, retried with backoff until delivered, counted in /metrics; a job's own
webhook_url only for allowed hosts."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from server.jobs.model import JobStore
from server.jobs.offloop import AsyncJobStore
from server.jobs.opening import open_job_store
from server.jobs.sqlite import SQLiteJobStore
from server.metrics import Metrics
from server.settings import ServeSettings
from server.webhooks import SERVER_SIGNER, WebhookEvent, WebhookSender
from tests.polling import until
from tests.server.counters import labelled_count
from tests.server.test_videos_api import Harness, poll
from tests.webhook_receiver import webhook_receiver

SECRET = "whsec_" + base64.b64encode(b"a test secret of 24 bytes").decode()
OTHER_SECRET = "whsec_" + base64.b64encode(os.urandom(24)).decode()
SERVER_SECRETS = {SERVER_SIGNER: SECRET}  # a sender with --webhook-secret only


def attempts(metrics: Metrics, event: str, outcome: str) -> float:
    return labelled_count(metrics, "diffbatch_webhook_attempts_total", event=event, outcome=outcome)


async def test_an_event_is_signed_per_standard_webhooks_in_openais_shape() -> None:
    metrics = Metrics()
    sender = WebhookSender(SERVER_SECRETS, metrics, backoff_s=0.01)
    event = WebhookEvent.for_video("video.completed", "video_123")
    with webhook_receiver() as receiver:
        assert await sender.send(receiver.url, event)
    await sender.close()
    [got] = receiver.received
    payload = Webhook(SECRET).verify(got.body, got.headers)
    assert payload == {
        "id": event.id,
        "object": "event",
        "type": "video.completed",
        "created_at": event.created_at,
        "data": {"id": "video_123"},
    }
    assert got.headers["webhook-id"] == event.id and got.headers["content-type"] == "application/json"
    # The official client verifies it too (what an OpenAI webhook receiver already runs).
    openai.OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.verify_signature(got.body, got.headers)
    assert attempts(metrics, "video.completed", "delivered") == 1


async def test_a_bad_secret_fails_verification() -> None:
    sender = WebhookSender(SERVER_SECRETS, Metrics())
    with webhook_receiver() as receiver:
        assert await sender.send(receiver.url, WebhookEvent.for_video("video.failed", "video_1"))
    await sender.close()
    [got] = receiver.received
    with pytest.raises(WebhookVerificationError):
        Webhook(OTHER_SECRET).verify(got.body, got.headers)
    tampered = got.body.replace(b"video_1", b"video_2")
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(tampered, got.headers)


async def test_a_receiver_that_fails_twice_gets_the_event_on_the_third_attempt() -> None:
    metrics = Metrics()
    sender = WebhookSender(SERVER_SECRETS, metrics, attempts=5, backoff_s=0.01)
    with webhook_receiver(500, 503) as receiver:
        assert await sender.send(receiver.url, WebhookEvent.for_video("video.completed", "video_1"))
    await sender.close()
    assert len(receiver.received) == 3
    assert len({got.headers["webhook-id"] for got in receiver.received}) == 1  # one event, three tries
    for got in receiver.received:
        Webhook(SECRET).verify(got.body, got.headers)  # each attempt signed afresh
    assert attempts(metrics, "video.completed", "refused") == 2
    assert attempts(metrics, "video.completed", "delivered") == 1


async def test_an_event_is_given_up_after_its_attempts_and_an_unreachable_receiver_counts() -> None:
    metrics = Metrics()
    sender = WebhookSender(SERVER_SECRETS, metrics, attempts=2, backoff_s=0.01)
    with webhook_receiver() as receiver:
        url = receiver.url
    # The receiver is gone: connections are refused.
    assert not await sender.send(url, WebhookEvent.for_video("video.failed", "video_1"))
    await sender.close()
    assert attempts(metrics, "video.failed", "error") == 2
    dropped = metrics.registry.get_sample_value(
        "diffbatch_webhook_events_dropped_total", {"event": "video.failed"}
    )
    assert dropped == 1


def test_the_backoff_doubles_up_to_its_cap() -> None:
    sender = WebhookSender(SERVER_SECRETS, Metrics(), backoff_s=1.0)
    sender_delays = [sender.backoff(n) for n in (1, 2, 3, 20)]
    for delay, base in zip(sender_delays, (1.0, 2.0, 4.0, 600.0), strict=True):
        assert base <= delay <= base * 1.1


async def test_a_finished_video_is_announced_to_the_server_url_and_its_own(tmp_path: Path) -> None:
    with webhook_receiver() as server_hook, webhook_receiver(500) as own_hook:
        settings = {
            "webhook_url": server_hook.url,
            "webhook_secret": SECRET,
            "allowed_webhook_hosts": "127.0.0.1",
            "webhook_backoff_s": 0.01,
        }
        harness = Harness(tmp_path, None, **settings)
        async with harness as client:
            body = {"prompt": "a boat", "seconds": 1, "webhook_url": own_hook.url}
            created = (await client.post("/v1/videos", json=body)).json()
            await poll(client, created["id"], {"completed"})
            # Counted once the sender has read the answer (after the receiver recorded it).
            counted = harness.app.state.diffbatch.metrics
            await until(lambda: attempts(counted, "video.completed", "delivered") == 2, "both told")
            metrics = (await client.get("/metrics")).text
        assert len(server_hook.received) == 1 and len(own_hook.received) == 2
        for got in (server_hook.received[0], own_hook.received[-1]):
            event = Webhook(SECRET).verify(got.body, got.headers)
            assert event["type"] == "video.completed" and event["data"] == {"id": created["id"]}
        assert 'diffbatch_webhook_attempts_total{event="video.completed",outcome="refused"} 1.0' in metrics
        assert 'diffbatch_webhook_attempts_total{event="video.completed",outcome="delivered"} 2.0' in metrics


async def test_a_failed_video_is_announced(tmp_path: Path) -> None:
    with webhook_receiver() as hook:
        settings = {"webhook_url": hook.url, "webhook_secret": SECRET}
        async with Harness(tmp_path, None, **settings) as client:
            # The fake pipeline fails a prompt that says so (tests/engine/fakes.py).
            created = (await client.post("/v1/videos", json={"prompt": "FAIL", "seconds": 1})).json()
            await poll(client, created["id"], {"failed"})
            await until(lambda: len(hook.received) == 1, "the receiver told")
        event = json.loads(hook.received[0].body)
        assert event["type"] == "video.failed" and event["data"] == {"id": created["id"]}


@pytest.mark.parametrize(
    ("allowed", "url", "says"),
    [
        (None, "http://127.0.0.1:9/x", "it allows none: --allowed-webhook-hosts"),
        ("hooks.example.com", "http://127.0.0.1:9/x", "host '127.0.0.1' is not one"),
        ("*.example.com", "ftp://hooks.example.com/x", "http:// or https://"),
    ],
)
async def test_a_webhook_url_of_a_host_not_allowed_is_a_400_naming_it(
    tmp_path: Path, allowed: str | None, url: str, says: str
) -> None:
    settings = {"allowed_webhook_hosts": allowed, "webhook_secret": SECRET}
    async with Harness(tmp_path, None, **settings) as client:
        answer = await client.post("/v1/videos", json={"prompt": "a boat", "seconds": 1, "webhook_url": url})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "webhook_url" and says in error["message"]


def test_webhooks_need_a_well_formed_secret() -> None:
    with pytest.raises(ValueError, match="webhook_secret is needed"):
        ServeSettings.model_validate({"webhook_url": "http://hooks.example.com/x"})
    with pytest.raises(ValueError, match="whsec_ followed by the base64"):
        ServeSettings.model_validate({"webhook_secret": "whsec_not base64!"})


async def test_a_job_failed_at_shutdown_is_announced_before_the_server_ends(tmp_path: Path) -> None:
    with webhook_receiver() as hook:
        harness = Harness(tmp_path, None, webhook_url=hook.url, webhook_secret=SECRET)
        async with harness as client:
            gate = harness.pipeline.gate = threading.Event()
            cut = (await client.post("/v1/videos", json={"prompt": "cut short", "seconds": 1})).json()
            await asyncio.to_thread(harness.pipeline.started.wait, 5)
            # The forward ends only once the stop has failed the job (as a running job's
            # would end after it): released by the store's fail, not by a timer.
            store = harness.app.state.diffbatch.video_service().store
            fail = store.fail

            async def fail_then_release(*args: str) -> bool:
                failed: bool = await fail(*args)
                gate.set()
                return failed

            store.fail = fail_then_release
            threading.Timer(30, gate.set).start()  # never hang the suite if the stop regressed
        [got] = hook.received  # delivered during the shutdown, not dropped
    assert Webhook(SECRET).verify(got.body, got.headers)["data"] == {"id": cut["id"]}
    assert json.loads(got.body)["type"] == "video.failed"


async def test_jobs_cut_short_by_the_last_shutdown_are_announced_at_the_next_start(tmp_path: Path) -> None:
    (tmp_path / "videos").mkdir(parents=True)
    # A job of the server that crashed on this output directory.
    before = SQLiteJobStore(tmp_path / "videos" / "videos.sqlite3", 3600, owner="before", lease_s=60)
    job = before.create(model="m", prompt="p", seconds="1", size="32x32", settings="{}")
    before.close()
    with webhook_receiver() as hook:
        async with Harness(tmp_path, None, webhook_url=hook.url, webhook_secret=SECRET) as client:
            await until(lambda: len(hook.received) == 1, "the failed job announced")
            assert (await client.get(f"/v1/videos/{job.id}")).json()["status"] == "failed"
    event = Webhook(SECRET).verify(hook.received[0].body, hook.received[0].headers)
    assert event["type"] == "video.failed" and event["data"] == {"id": job.id}


async def test_a_job_of_a_dead_server_is_announced_by_the_one_that_fails_it(tmp_path: Path) -> None:
    with webhook_receiver() as server_hook, webhook_receiver() as own_hook:
        settings = {
            "webhook_url": server_hook.url,
            "webhook_secret": SECRET,
            "allowed_webhook_hosts": "127.0.0.1",
        }
        harness = Harness(tmp_path, None, **settings)
        async with harness as client:
            service = harness.app.state.diffbatch.video_service()
            # Another server's job on the same table, whose lease has run out (it died).
            dead = SQLiteJobStore(tmp_path / "videos" / "videos.sqlite3", 3600, owner="dead", lease_s=-1)
            job = dead.create(
                model="m",
                prompt="p",
                seconds="1",
                size="32x32",
                settings=json.dumps({"webhook_url": own_hook.url}),
            )
            dead.close()
            await service._leases.renew_once()
            await until(lambda: len(server_hook.received) == len(own_hook.received) == 1, "both told")
            assert (await client.get(f"/v1/videos/{job.id}")).json()["error"]["code"] == "server_lost"
        for got in (server_hook.received[0], own_hook.received[0]):
            event = Webhook(SECRET).verify(got.body, got.headers)
            assert event["type"] == "video.failed" and event["data"] == {"id": job.id}


async def test_a_jobs_own_webhook_url_is_kept_with_it_and_not_inherited_by_a_remix(tmp_path: Path) -> None:
    with webhook_receiver() as own_hook:
        settings = {"webhook_secret": SECRET, "allowed_webhook_hosts": "127.0.0.1"}
        harness = Harness(tmp_path, None, **settings)
        async with harness as client:
            body = {"prompt": "a boat", "seconds": 1, "webhook_url": own_hook.url}
            created = (await client.post("/v1/videos", json=body)).json()
            await poll(client, created["id"], {"completed"})
            store = harness.app.state.diffbatch.video_service().store
            kept = await store.get(created["id"])
            # Where a server that did not take the request finds it (a dead server's job).
            assert kept is not None and json.loads(kept.settings or "{}")["webhook_url"] == own_hook.url
            remix = (await client.post(f"/v1/videos/{created['id']}/remix", json={"prompt": "a ship"})).json()
            await poll(client, remix["id"], {"completed"})
            counted = harness.app.state.diffbatch.metrics
            await until(lambda: attempts(counted, "video.completed", "delivered") == 1, "the first told")
        assert [json.loads(got.body)["data"]["id"] for got in own_hook.received] == [created["id"]]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_delivery_still_retrying_at_shutdown_is_finished_by_the_next_server(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The receiver refuses the first attempt; the server stops while it waits to retry; the
    next server on the store (a restart, or on PostgreSQL any other) delivers the same event."""
    location = None if kind == "sqlite" else request.getfixturevalue("database_url")

    def opener(owner: str) -> Callable[[], JobStore]:
        return lambda: open_job_store(location, tmp_path / "videos.sqlite3", 60, lease_s=60, owner=owner)

    stores = [await AsyncJobStore.open(opener(owner), 5) for owner in "abc"]
    first, second = Metrics(), Metrics()
    event = WebhookEvent.for_video("video.completed", "video_1")
    with webhook_receiver(503) as receiver:
        a = WebhookSender(SERVER_SECRETS, first, attempts=3, backoff_s=3600, journal=stores[0])
        a.send(receiver.url, event)
        await until(lambda: attempts(first, "video.completed", "refused") == 1, "the first attempt refused")
        await a.close(grace_s=0)  # stopped while waiting an hour to retry
        b = WebhookSender(SERVER_SECRETS, second, attempts=3, backoff_s=0.01, journal=stores[1])
        assert await b.resume_abandoned() == 1
        await until(lambda: len(receiver.received) == 2, "the event delivered by the next server")
        await b.close()
    assert [got.headers["webhook-id"] for got in receiver.received] == [event.id, event.id]
    assert Webhook(SECRET).verify(receiver.received[1].body, receiver.received[1].headers)["id"] == event.id
    assert attempts(second, "video.completed", "delivered") == 1
    assert await stores[2].keep_deliveries() == []  # delivered: nothing left to resume
    for store in stores:
        await store.close()


async def test_a_server_restarted_delivers_what_its_last_process_left(tmp_path: Path) -> None:
    settings = {"webhook_secret": SECRET, "webhook_attempts": 3, "webhook_backoff_s": 3600}
    with webhook_receiver(503) as hook:
        async with Harness(tmp_path, None, webhook_url=hook.url, **settings) as client:
            job = (await client.post("/v1/videos", json={"prompt": "p", "seconds": 1})).json()
            await until(lambda: len(hook.received) == 1, "the first attempt refused")
        # Stopped while the delivery waited an hour to retry: the restart takes it up.
        async with Harness(tmp_path, None, webhook_url=hook.url, **settings):
            await until(lambda: len(hook.received) == 2, "delivered after the restart")
    event = Webhook(SECRET).verify(hook.received[1].body, hook.received[1].headers)
    assert event["type"] == "video.completed" and event["data"] == {"id": job["id"]}
    assert hook.received[0].headers["webhook-id"] == hook.received[1].headers["webhook-id"]
