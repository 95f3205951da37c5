"""`AsyncJobStore` over a real SQLite store: a call stuck in the database costs its callers
the deadline and no more, a call its caller gave up on never runs late, and what a call
that answered too late made is undone (a job nobody runs, a key nobody holds)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from server.jobs.model import JobStore, JobStoreUnavailableError
from server.jobs.offloop import AsyncJobStore
from server.jobs.sqlite import SQLiteJobStore

DEADLINE_S = 1.0


async def open_store(tmp_path: Path) -> AsyncJobStore:
    return await AsyncJobStore.open(
        lambda: SQLiteJobStore(tmp_path / "videos.sqlite3", 3600, owner="a", lease_s=60), DEADLINE_S
    )


async def test_calls_behind_a_stuck_one_end_within_their_deadline_and_never_run_late(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    thawed = threading.Event()
    ran: list[str] = []

    def frozen(_: JobStore) -> None:
        thawed.wait(30)  # a database that does not answer (SIGSTOP) until the test says so

    try:
        with pytest.raises(JobStoreUnavailableError, match="did not answer within"):
            await store.call(frozen)
        for _ in range(3):
            asked = time.monotonic()
            with pytest.raises(JobStoreUnavailableError):
                await store.call(lambda _: ran.append("late"))
            assert time.monotonic() - asked < DEADLINE_S + 1
        assert store.status()["status"] == "unavailable"
    finally:
        thawed.set()
    job = await store.create(model="m", prompt="p", seconds="1", size="32x32")
    assert (await store.get(job.id)) == job
    assert ran == [] and store.status() == {"status": "ok"}
    await store.close()


async def test_a_job_recorded_after_its_request_gave_up_is_failed_not_left_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await open_store(tmp_path)
    thawed = threading.Event()
    create = SQLiteJobStore.create

    def slow_create(self: SQLiteJobStore, **fields: Any) -> Any:
        thawed.wait(30)
        return create(self, **fields)

    monkeypatch.setattr(SQLiteJobStore, "create", slow_create)
    try:
        with pytest.raises(JobStoreUnavailableError):
            await store.create(model="m", prompt="p", seconds="1", size="32x32")
    finally:
        thawed.set()
    (late,), _ = await store.page(after=None, limit=10, order="asc")  # runs after the late create
    assert late.status == "failed" and late.error_code == "job_store_unavailable"
    await store.close()


async def test_a_key_claimed_after_its_request_gave_up_is_free_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await open_store(tmp_path)
    thawed = threading.Event()
    claim = SQLiteJobStore.claim_key

    def slow_claim(self: SQLiteJobStore, *args: Any) -> Any:
        thawed.wait(30)
        return claim(self, *args)

    monkeypatch.setattr(SQLiteJobStore, "claim_key", slow_claim)
    try:
        with pytest.raises(JobStoreUnavailableError):
            await store.claim_key("k", "digest", 3600, 60)
    finally:
        thawed.set()
    monkeypatch.setattr(SQLiteJobStore, "claim_key", claim)
    assert await store.claim_key("k", "another digest", 3600, 60) is None  # not held by the lost one
    await store.close()
