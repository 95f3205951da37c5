"""A job store that does not answer stalls nothing else and loses nothing: an SQLite file
another process holds locked (`BEGIN EXCLUSIVE`) leaves `/health` answering at once while a
video POST waits for the lock, that POST is a 503 `job_store_unavailable` within the
deadline, and a video finished meanwhile is recorded completed, with its webhook, once the
lock is gone. In process; the PostgreSQL freeze (SIGSTOP) is `tests/e2e/test_store_outage.py`."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

from standardwebhooks import Webhook

from tests.polling import until
from tests.server.test_videos_api import Harness, poll
from tests.server.test_webhooks import SECRET
from tests.webhook_receiver import webhook_receiver

# The deadline (--database-timeout-s) and SQLite's own busy timeout, both 5 s by default.
DEADLINE_S = 5.0


async def test_a_locked_sqlite_store_stalls_neither_health_nor_the_server(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        locker = sqlite3.connect(tmp_path / "videos" / "videos.sqlite3", isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")  # another process holds the file
        try:
            began = time.monotonic()
            post = asyncio.create_task(client.post("/v1/videos", json={"prompt": "a", "seconds": 1}))
            health_s: list[float] = []
            while not post.done():  # every stall of the event loop falls inside one of these
                asked = time.monotonic()
                health = await client.get("/health")
                health_s.append(time.monotonic() - asked)
                assert health.status_code == 200
            refused = await post
            waited_s = time.monotonic() - began
            # A loop stalled on the lock would hold one /health for the whole busy timeout
            # (DEADLINE_S); half of it leaves a loaded machine room without hiding a stall.
            slowest = max(health_s)
            assert slowest < DEADLINE_S / 2, f"/health took {slowest:.1f} s while the store was locked"
            assert len(health_s) >= 3, "/health answered only around the lock's wait, not during it"
            degraded = (await client.get("/health")).json()["degraded"]["job_store"]
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "job_store_unavailable"
        assert waited_s < DEADLINE_S + 1
        assert degraded["status"] == "unavailable" and degraded["reason"]
        # Unlocked: the next POST is recorded and runs, and /health is whole again.
        made = (await client.post("/v1/videos", json={"prompt": "b", "seconds": 1})).json()
        assert (await poll(client, made["id"], {"completed", "failed"}))["status"] == "completed"
        await until(
            lambda: "degraded" not in harness.app.state.diffbatch.videos.store.status(), "the store healthy"
        )
        assert "degraded" not in (await client.get("/health")).json()


async def test_a_video_finished_while_the_store_is_locked_completes_once_it_is_back(tmp_path: Path) -> None:
    with webhook_receiver() as hook:
        harness = Harness(tmp_path, webhook_url=hook.url, webhook_secret=SECRET)
        async with harness as client:
            gate = harness.pipeline.gate = threading.Event()
            job = (await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})).json()
            await asyncio.to_thread(harness.pipeline.started.wait, 5)
            locker = sqlite3.connect(tmp_path / "videos" / "videos.sqlite3", isolation_level=None)
            locker.execute("BEGIN EXCLUSIVE")
            try:
                gate.set()  # the video is made while the store cannot record it
                mp4 = tmp_path / "videos" / f"{job['id']}.mp4"
                await until(mp4.exists, "the video's MP4 written")

                async def degraded() -> bool:
                    return "degraded" in (await client.get("/health")).json()

                await until(degraded, "the completion refused by the locked store")
                # A read may queue behind the completion's next try and time out with it on a
                # busy machine (503): either way the job is not reported completed.
                answer = await client.get(f"/v1/videos/{job['id']}")
                if answer.status_code == 503:
                    assert answer.json()["error"]["code"] == "job_store_unavailable", answer.text
                else:
                    assert answer.json()["status"] != "completed", answer.text
                assert hook.received == []
            finally:
                locker.execute("ROLLBACK")
                locker.close()
            done = await poll(client, job["id"], {"completed", "failed"})
            assert done["status"] == "completed" and done["progress"] == 100
            await until(lambda: len(hook.received) == 1, "its webhook delivered")
    event = Webhook(SECRET).verify(hook.received[0].body, hook.received[0].headers)
    assert event["type"] == "video.completed" and event["data"] == {"id": job["id"]}
