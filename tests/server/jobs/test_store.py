"""The video job table on both stores: states, paging, restarts, expiry, leases shared by
several servers, and databases written by older versions, without a server."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest

from server.jobs.files import VideoFiles, orphans
from server.jobs.migrations import LATEST, VIDEOS_V1
from server.jobs.model import (
    SERVER_LOST,
    JobStore,
    JobStoreUnavailableError,
    KeyRecord,
    PendingDelivery,
    VideoJob,
    VideoStatus,
)
from server.jobs.opening import open_job_store
from server.jobs.sqlite import SYNCED, SQLiteJobStore
from server.outputs.local import PARTIAL_SUFFIX, LocalOutputStore
from server.videos.polling import POLL_MAX_MS, POLL_MIN_MS, POLL_QUEUED_MS, JobDurations, poll_after_ms
from tests.server.jobs.conftest import OpenStore

# A lease that has already run out when it is written: no test waits for a clock.
LAPSED = -1.0


def test_lifecycle_restart_and_expiry(open_store: OpenStore) -> None:
    # The first process's leases lapse at once, as a dead server's would have by the restart.
    store = open_store(lease_s=LAPSED)
    done = store.create(model="m", prompt="a", seconds="4", size="32x32")
    running = store.create(model="m", prompt="b", seconds="4", size="32x32")
    queued = store.create(model="m", prompt="c", seconds="4", size="32x32")
    store.mark_running(done.id)
    store.set_progress(done.id, 40)
    assert store.get(done.id).progress == 40  # type: ignore[union-attr]
    store.complete(done.id)
    store.mark_running(running.id)
    store.fail(done.id, "late", "a finished job cannot fail")
    assert store.get(done.id).status == "completed"  # type: ignore[union-attr]
    store.close()

    reopened = open_store(ttl_s=0.1)  # a restart; jobs completed from now on expire at once
    assert len(reopened.fail_interrupted()) == 2
    for job_id in (running.id, queued.id):
        job = reopened.get(job_id)
        assert (
            job is not None and job.status == "failed" and job.error_code in ("server_restarted", SERVER_LOST)
        )
    page, more = reopened.page(after=None, limit=2, order="asc")
    assert [j.id for j in page] == [done.id, running.id] and more
    # A job ends once: a job failed by the restart never turns completed afterwards.
    assert reopened.complete(running.id) is False
    assert reopened.get(running.id).status == "failed"  # type: ignore[union-attr]
    short = reopened.create(model="m", prompt="d", seconds="4", size="32x32")
    assert reopened.complete(short.id) is True
    # The completed job and both failed ones (they expire like videos) are gone.
    assert sorted(reopened.take_expired()) == sorted([short.id, running.id, queued.id])
    assert reopened.get(short.id) is None and reopened.get(running.id) is None
    assert reopened.get(done.id) is not None  # completed with a one-hour lifetime: kept


def test_paging_and_unknown_cursor(open_store: OpenStore) -> None:
    store = open_store()
    ids = [store.create(model="m", prompt=str(i), seconds="4", size="32x32").id for i in range(5)]
    page, more = store.page(after=ids[1], limit=2, order="asc")
    assert [j.id for j in page] == ids[2:4] and more
    page, more = store.page(after=ids[1], limit=5, order="desc")
    assert [j.id for j in page] == [ids[0]] and not more
    assert store.delete(ids[1]) and not store.delete(ids[1])
    with pytest.raises(KeyError):
        store.page(after=ids[1], limit=2, order="asc")


def test_a_tenant_reads_its_own_jobs_only_and_no_tenant_reads_all(open_store: OpenStore) -> None:
    a, b = open_store(owner="a"), open_store(owner="b")  # two servers, one database
    before = a.create(model="m", prompt="of no tenant", seconds="4", size="32x32")
    mine = [a.create(model="m", prompt=str(i), seconds="4", size="32x32", tenant="t1") for i in range(3)]
    theirs = b.create(model="m", prompt="theirs", seconds="4", size="32x32", tenant="t2")
    assert b.get(mine[0].id, tenant="t1") == mine[0]
    assert b.get(theirs.id, tenant="t1") is None and b.get(before.id, tenant="t1") is None
    assert b.get(theirs.id) == theirs and b.get(before.id) == before  # tenant None: every job
    page, more = b.page(after=None, limit=2, order="asc", tenant="t1")
    assert [j.id for j in page] == [j.id for j in mine[:2]] and more
    page, more = b.page(after=mine[1].id, limit=2, order="asc", tenant="t1")
    assert [j.id for j in page] == [mine[2].id] and not more
    with pytest.raises(KeyError):  # another tenant's id is no cursor, as an unknown one
        b.page(after=theirs.id, limit=2, order="asc", tenant="t1")
    everything, _ = b.page(after=None, limit=10, order="asc")
    assert [j.id for j in everything] == [before.id, *(j.id for j in mine), theirs.id]


def test_a_job_is_seen_and_deleted_by_every_server_but_kept_alive_by_its_own(open_store: OpenStore) -> None:
    a, b = open_store(owner="a"), open_store(owner="b")
    first = a.create(model="m", prompt="p", seconds="4", size="32x32")
    second = b.create(model="m", prompt="q", seconds="4", size="32x32")
    page, _ = b.page(after=None, limit=10, order="asc")
    assert [j.id for j in page] == [first.id, second.id]  # one creation order across servers
    assert a.renew_leases() == {first.id} and b.renew_leases() == {second.id}
    a.mark_running(first.id)
    assert b.get(first.id).status == "in_progress"  # type: ignore[union-attr]
    assert b.fail_abandoned() == []  # a's lease holds
    assert b.delete(first.id)
    # a learns at its next renewal that its job is gone, and stops running it.
    assert a.renew_leases() == set()
    assert a.complete(first.id) is False


def test_a_job_whose_server_stopped_renewing_fails_with_a_reason(open_store: OpenStore) -> None:
    dead, alive = open_store(owner="dead", lease_s=LAPSED), open_store(owner="alive")
    lost = dead.create(model="m", prompt="p", seconds="4", size="32x32")
    dead.mark_running(lost.id)
    kept = alive.create(model="m", prompt="q", seconds="4", size="32x32")
    assert len(alive.fail_abandoned()) == 1 and alive.fail_abandoned() == []
    job = alive.get(lost.id)
    assert job is not None and job.status == "failed" and job.error_code == SERVER_LOST
    assert "stopped before it was finished" in (job.error_message or "")
    assert job.expires_at is not None
    assert alive.get(kept.id).status == "queued"  # type: ignore[union-attr]
    # The dead server, back after all, finds its job failed: it neither renews nor completes it.
    assert dead.renew_leases() == set() and dead.complete(lost.id) is False


def test_a_shared_store_leaves_other_servers_jobs_alone_at_start_up(
    open_store: OpenStore, store_kind: str
) -> None:
    running = open_store(owner="a")
    job = running.create(model="m", prompt="p", seconds="4", size="32x32")
    starting = open_store(owner="b")
    if store_kind == "sqlite":  # one server per file: whatever is unfinished is its own last one's
        assert not starting.shared and len(starting.fail_interrupted()) == 1
    else:
        assert starting.shared and starting.fail_interrupted() == []
        assert starting.get(job.id).status == "queued"  # type: ignore[union-attr]


def test_each_expired_job_is_taken_by_one_server(open_store: OpenStore) -> None:
    a, b = open_store(owner="a", ttl_s=-1), open_store(owner="b", ttl_s=-1)
    ids = {a.create(model="m", prompt=str(i), seconds="4", size="32x32").id for i in range(4)}
    for job_id in ids:
        a.complete(job_id)
    taken_a, taken_b = a.take_expired(), b.take_expired()
    assert sorted(taken_a + taken_b) == sorted(ids) and taken_b == []


def test_files_no_job_owns_are_purged_once_unused(open_store: OpenStore, tmp_path: Path) -> None:
    store, outputs = open_store(), LocalOutputStore(tmp_path)
    files = VideoFiles(outputs)

    def purge(in_use: set[str], min_age_s: float) -> int:
        found = orphans(files.settled(in_use, min_age_s), store.exists)
        outputs.delete(found)
        return len(found)

    def partial(job_id: str) -> Path:  # a crash mid-write
        return outputs.path(files.key(job_id, "video") + PARTIAL_SUFFIX)

    kept = store.create(model="m", prompt="a", seconds="4", size="32x32")
    files.write(kept.id, "video", b"mp4")
    deleted = store.create(model="m", prompt="b", seconds="4", size="32x32")
    store.delete(deleted.id)  # a download had just opened its files: they were kept
    files.write(deleted.id, "video", b"mp4")
    files.write(deleted.id, "thumbnail", b"png")
    partial(kept.id).write_bytes(b"half")
    writing = store.create(model="m", prompt="c", seconds="4", size="32x32")
    partial(writing.id).write_bytes(b"half")
    assert purge(set(), min_age_s=60) == 0  # too fresh: maybe still in use
    assert purge({deleted.id, kept.id, writing.id}, min_age_s=0) == 0
    assert purge({writing.id}, min_age_s=0) == 3
    assert files.read(kept.id, "video") == b"mp4" and partial(writing.id).exists()
    assert not partial(kept.id).exists()
    with pytest.raises(FileNotFoundError):
        files.read(deleted.id, "video")


def test_the_poll_interval_follows_what_is_left() -> None:
    def job(status: VideoStatus, progress: int) -> VideoJob:
        return VideoJob("v", status, progress, 1000, None, None, "m", "p", "4", "32x32", None, None)

    assert poll_after_ms(job("queued", 0), 1010) == POLL_QUEUED_MS
    assert poll_after_ms(job("in_progress", 50), 1010) == 2500  # 10 s done, 10 s left: a quarter
    assert poll_after_ms(job("in_progress", 99), 1010) == POLL_MIN_MS
    assert poll_after_ms(job("in_progress", 1), 2000) == POLL_MAX_MS
    assert poll_after_ms(job("completed", 100), 2000) is None
    # Without progress: a quarter of what the model's videos take lately, up to a second
    # (the official client keeps its first poll's interval for the whole job).
    assert poll_after_ms(job("queued", 0), 1000.5, typical_s=2.5) == 500
    assert poll_after_ms(job("queued", 0), 1000.0, typical_s=0.12) == POLL_MIN_MS
    assert poll_after_ms(job("in_progress", 0), 1000.0, typical_s=60.0) == POLL_QUEUED_MS
    assert poll_after_ms(job("queued", 0), 1100.0, typical_s=2.0) == POLL_MIN_MS  # overdue


def test_a_models_typical_video_duration_follows_its_recent_videos() -> None:
    durations = JobDurations()
    assert durations.typical_s("m") is None
    durations.note("m", 10.0)
    durations.note("m", 20.0)
    assert durations.typical_s("m") == pytest.approx(13.0) and durations.typical_s("other") is None


# A row as the server wrote it before schema versions (schema 1, today's release).
_OLD_ROW = (
    "INSERT INTO videos (id, status, created_at, model, prompt, seconds, size, seq, settings) "
    "VALUES ('video_old', 'completed', 1, 'm', 'p', '4', '48x32', 7, '{}')"
)
_OLD_RUNNING = (
    "INSERT INTO videos (id, status, created_at, model, prompt, seconds, size, seq) "
    "VALUES ('video_cut', 'in_progress', 2, 'm', 'p', '4', '48x32', 8)"
)


def _write_old_database(location: str | None, tmp_path: Path, create: str = VIDEOS_V1) -> None:
    if location is None:
        with sqlite3.connect(tmp_path / "videos.sqlite3") as old:
            for statement in (create, _OLD_ROW, _OLD_RUNNING):
                old.execute(statement)
        old.close()
    else:
        with psycopg.connect(location, autocommit=True) as conn:
            for statement in (create, _OLD_ROW, _OLD_RUNNING):
                conn.execute(statement)


def test_a_database_written_before_schema_versions_is_upgraded_in_place(
    open_store: OpenStore, location: str | None, tmp_path: Path
) -> None:
    _write_old_database(location, tmp_path)
    store = open_store()
    assert store.upgraded_from == 0
    kept = store.get("video_old")
    assert kept is not None and (kept.status, kept.size, kept.settings) == ("completed", "48x32", "{}")
    assert store.get("video_old", tenant="t1") is None  # a row from before tenants is no key's
    # A job the old server left running has no lease: it is failed at start-up, never left running.
    assert len(store.fail_interrupted()) == 1
    assert store.get("video_cut").status == "failed"  # type: ignore[union-attr]
    new = store.create(
        model="m", prompt="q", seconds="4", size="48x32", settings="{}", remixed_from="video_old"
    )
    assert (new.settings, new.remixed_from) == ("{}", "video_old")
    page, _ = store.page(after="video_cut", limit=5, order="asc")
    assert [j.id for j in page] == [new.id]  # the order continues after the old rows
    store.close()
    assert open_store().upgraded_from == LATEST  # nothing left to do


def run_statements(location: str | None, tmp_path: Path, statements: tuple[str, ...]) -> None:
    """Run `statements` on the store's database (SQLite in `tmp_path` where `location` is
    None): a schema taken back to an older version, as a server before it wrote it."""
    if location is None:
        with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
            for statement in statements:
                db.execute(statement)
        db.close()
    else:
        with psycopg.connect(location, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)


def test_keys_from_schema_3_are_kept_when_image_responses_arrive(
    open_store: OpenStore, location: str | None, tmp_path: Path
) -> None:
    store = open_store()
    assert store.claim_key("k", "body", 60, 60) is None
    store.bind_key("k", "video_1")
    store.close()
    # Back to schema 3 as a server before image keys wrote it: no response column.
    back = (
        "ALTER TABLE idempotency_keys DROP COLUMN response",
        "DROP TABLE webhook_deliveries",  # (schema 5)
        "DROP INDEX videos_by_tenant",  # (schema 6)
        "ALTER TABLE videos DROP COLUMN tenant",
        "UPDATE diffbatch_schema SET version = 3",
    )
    run_statements(location, tmp_path, back)
    store = open_store()
    assert store.upgraded_from == 3
    assert store.claim_key("k", "body", 60, 60) == KeyRecord("body", "video_1", None)


def test_deliveries_from_schema_5_are_kept_as_signed_by_the_server(
    open_store: OpenStore, location: str | None, tmp_path: Path
) -> None:
    """Before deliveries named their signer, the server's secret signed them all."""
    store = open_store(owner="a")
    store.add_delivery(DELIVERY)
    store.release_deliveries()
    store.close()
    back = (
        "ALTER TABLE webhook_deliveries DROP COLUMN signer",
        "DROP INDEX videos_by_tenant",
        "ALTER TABLE videos DROP COLUMN tenant",
        "UPDATE diffbatch_schema SET version = 5",
    )
    run_statements(location, tmp_path, back)
    store = open_store(owner="b")
    assert store.upgraded_from == 5
    assert store.keep_deliveries() == [replace(DELIVERY, signer="")]


def test_a_table_from_before_remix_gains_its_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    """SQLite only: PostgreSQL support came after remix."""
    before_remix = VIDEOS_V1.replace(",\n    settings TEXT,\n    remixed_from TEXT", "")
    assert "settings" not in before_remix
    with sqlite3.connect(tmp_path / "videos.sqlite3") as old:
        old.execute(before_remix)
        old.execute(_OLD_RUNNING)
    old.close()
    store = open_job_store(None, tmp_path / "videos.sqlite3", 60, lease_s=60)
    try:
        kept = store.get("video_cut")
        assert kept is not None and kept.settings is None and kept.remixed_from is None
    finally:
        store.close()


def test_a_database_from_a_newer_version_is_refused(
    open_store: OpenStore, location: str | None, tmp_path: Path
) -> None:
    open_store().close()
    bump = "UPDATE diffbatch_schema SET version = version + 1"
    if location is None:
        with sqlite3.connect(tmp_path / "videos.sqlite3") as db:
            db.execute(bump)
        db.close()
    else:
        with psycopg.connect(location, autocommit=True) as conn:
            conn.execute(bump)
    with pytest.raises(Exception, match="newer than this diffbatch"):
        open_store()


def test_an_idempotency_key_is_claimed_once_across_servers(open_store: OpenStore) -> None:
    a, b = open_store(owner="a"), open_store(owner="b")
    assert a.claim_key("k", "body-1", 60, 60) is None  # the first use
    assert b.claim_key("k", "body-1", 60, 60) == KeyRecord("body-1", None)  # a retry while it runs
    assert b.claim_key("k", "body-2", 60, 60) == KeyRecord("body-1", None)  # another body: the caller's 409
    job = a.create(model="m", prompt="p", seconds="4", size="32x32")
    a.bind_key("k", job.id)
    a.release_key("k")  # a key that made its video stays
    assert b.claim_key("k", "body-1", 60, 60) == KeyRecord("body-1", job.id)


def test_a_key_keeps_the_response_its_image_request_answered(open_store: OpenStore) -> None:
    a, b = open_store(owner="a"), open_store(owner="b")
    assert a.claim_key("k", "body", 60, 60) is None
    a.bind_response("k", '{"data": []}')
    a.release_key("k")  # a key that answered stays
    assert b.claim_key("k", "body", 60, LAPSED) == KeyRecord("body", None, '{"data": []}')  # never stale
    assert a.claim_key("big", "body", 60, 60) is None
    a.bind_response("big", "")  # answered, but too large to keep
    assert b.claim_key("big", "body", 60, LAPSED) == KeyRecord("body", None, "")


def test_a_released_or_lapsed_key_may_be_used_again(open_store: OpenStore) -> None:
    store = open_store()
    assert store.claim_key("failed", "body", 60, 60) is None
    store.release_key("failed")  # its request failed before making anything
    assert store.claim_key("failed", "other", 60, 60) is None
    assert store.claim_key("old", "body", LAPSED, 60) is None
    assert store.claim_key("old", "other", 60, 60) is None  # past its window: a new first use
    assert store.claim_key("short", "body", LAPSED, 60) is None
    assert store.purge_keys() == 1
    # A first use that never recorded its video (its server died) is taken over once stale.
    assert store.claim_key("stuck", "body", 60, 60) is None
    assert store.claim_key("stuck", "other", 60, 60) == KeyRecord("body", None)
    assert store.claim_key("stuck", "other", 60, LAPSED) is None


def test_servers_starting_together_migrate_once(open_store: OpenStore) -> None:
    def start(owner: int) -> int:
        store = open_store(owner=str(owner))
        store.close()  # in its own thread: SQLite's connections stay in theirs
        return store.upgraded_from

    with ThreadPoolExecutor(4) as pool:
        assert sorted(pool.map(start, range(4))) == [0, LATEST, LATEST, LATEST]
    store = open_store()
    assert store.get(store.create(model="m", prompt="p", seconds="4", size="32x32").id) is not None


def test_a_lost_database_connection_is_one_503_then_reconnected(database_url: str, tmp_path: Path) -> None:
    store = open_job_store(database_url, tmp_path / "unused.sqlite3", 60, lease_s=60)
    try:
        job = store.create(model="m", prompt="p", seconds="4", size="32x32")
        with psycopg.connect(database_url, autocommit=True) as admin:  # as a database restart does
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'diffbatch' AND datname = current_database()"
            )
        with pytest.raises(JobStoreUnavailableError, match="cannot be reached"):
            store.get(job.id)
        assert store.get(job.id) == job  # the next call connects again
    finally:
        store.close()


# Signed by a tenant's key (its digest: the secret is never stored).
DELIVERY = PendingDelivery(
    "evt_1", "http://hooks.example.com/x", "video.completed", 1_700_000_000, "video_1", signer="a1b2c3"
)


def test_a_webhook_delivery_left_at_shutdown_is_resumed_by_one_other_server(
    open_store: OpenStore, store_kind: str
) -> None:
    a = open_store(owner="a")
    a.add_delivery(DELIVERY)
    a.add_delivery(DELIVERY)  # recorded once
    a.record_attempts(DELIVERY.event_id, DELIVERY.url, 2)
    assert a.keep_deliveries() == []  # its own: renewed, not taken
    b = open_store(owner="b")
    if store_kind == "postgres":  # a shared store: a still renews it, it is a's to finish
        assert b.keep_deliveries() == []
    assert a.release_deliveries() == 1  # a stops
    assert b.keep_deliveries() == [replace(DELIVERY, attempts=2)]  # the attempts carry on
    assert b.keep_deliveries() == []  # b's now
    if store_kind == "postgres":  # (SQLite: one server per file, any other owner is its past)
        assert a.keep_deliveries() == []
    b.end_delivery(DELIVERY.event_id, DELIVERY.url)  # delivered
    assert b.release_deliveries() == 0 and open_store(owner="c").keep_deliveries() == []


def test_a_webhook_delivery_of_a_dead_server_is_taken_by_the_first_that_looks(
    open_store: OpenStore, store_kind: str
) -> None:
    dead = open_store(owner="dead", lease_s=LAPSED)
    dead.add_delivery(DELIVERY)
    alive = open_store(owner="alive")
    assert alive.keep_deliveries() == [DELIVERY] and alive.keep_deliveries() == []
    if store_kind == "postgres":  # alive's lease holds it now, against every other server
        assert open_store(owner="late").keep_deliveries() == [] and dead.keep_deliveries() == []


def test_api_processes_of_one_run_fail_an_earlier_runs_jobs_at_once_and_a_dead_siblings_at_its_lease(
    tmp_path: Path,
) -> None:
    """SQLite shared by the API processes of one server (`--api-server-count`): a new run
    (the whole server restarted) fails what the last run left at once, as one process does;
    within a run, a sibling's running job is left alone until its lease lapses."""

    def api_process(run: str, owner: str, lease_s: float = 3600) -> JobStore:
        return open_job_store(None, tmp_path / "videos.sqlite3", 60, lease_s=lease_s, owner=owner, run=run)

    last_run = api_process("run-1", "a")
    cut_short = last_run.create(model="m", prompt="a", seconds="4", size="32x32")
    last_run.mark_running(cut_short.id)
    last_run.add_delivery(DELIVERY)
    last_run.close()
    sibling = api_process("run-2", "b")
    alive = sibling.create(model="m", prompt="b", seconds="4", size="32x32")
    dying = api_process("run-2", "c", lease_s=LAPSED)
    dead = dying.create(model="m", prompt="c", seconds="4", size="32x32")
    dying.close()
    starting = api_process("run-2", "d")
    try:
        assert sorted(starting.fail_interrupted()) == sorted([cut_short.id, dead.id])
        assert starting.get(cut_short.id).error_code == "server_restarted"  # type: ignore[union-attr]
        assert starting.get(dead.id).error_code == SERVER_LOST  # type: ignore[union-attr]
        assert starting.get(alive.id).status == "queued"  # type: ignore[union-attr]
        # The last run's webhook delivery is taken over; a live sibling's stays its own.
        assert starting.keep_deliveries() == [DELIVERY]
        sibling.add_delivery(replace(DELIVERY, event_id="evt_sibling"))
        assert starting.keep_deliveries() == []
    finally:
        sibling.close()
        starting.close()


def test_sqlite_waits_for_the_disk_for_a_job_and_its_end_but_not_its_progress(tmp_path: Path) -> None:
    store = SQLiteJobStore(tmp_path / "videos.sqlite3", 3600, owner="a", lease_s=60)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)  # what SQLite runs, in order

    def writes(call: Callable[[], object]) -> list[tuple[str, str]]:
        """Each statement `call` commits (autocommit: one statement, one commit) and the
        `synchronous` it commits under."""
        statements.clear()
        call()
        level, found = SYNCED, []
        for statement in statements:
            if statement.startswith("PRAGMA synchronous="):
                level = statement.split("=", 1)[1]
            elif not statement.startswith("SELECT"):
                found.append((statement.split()[0], level))
        return found

    job = store.create(model="m", prompt="a", seconds="4", size="32x32")
    assert writes(lambda: store.create(model="m", prompt="b", seconds="4", size="32x32")) == [
        ("INSERT", "FULL")  # the accepted job: one commit, on the disk before it is answered
    ]
    assert writes(lambda: store.mark_running(job.id)) == [("UPDATE", "NORMAL")]
    assert writes(lambda: store.set_progress(job.id, 50)) == [("UPDATE", "NORMAL")]
    assert writes(lambda: store.complete(job.id)) == [("UPDATE", "FULL")]
    assert store._db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL again
    store.close()
