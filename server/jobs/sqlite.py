"""The default job store: an SQLite file under `--output-dir`, for one server.

One server per output directory (`server/output_dir.py` locks it), so at start-up every
job left unfinished is its own previous process's and can never finish. The connection
is opened and used in the job store's thread only (`server/jobs/offloop.py`).

`run`: the API processes of one server (`--api-server-count`) share the file, each with
its own connection (SQLite locks the file between processes; an idempotency key's claim is
one statement), each owner naming the server's run (its supervisor's start). An API process
starting up fails the jobs of an earlier run at once (`server_restarted`, as one process
does: that server is gone), and of its own run only those whose lease lapsed (a dead
sibling's, `server_lost`), never its siblings' running ones.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path
from typing import Literal

from server.jobs.migrations import migrate_sqlite
from server.jobs.model import DELIVERY_COLUMNS, JOB_COLUMNS, SERVER_LOST, KeyRecord, PendingDelivery, VideoJob

_UNFINISHED = "status IN ('queued', 'in_progress')"
# SQLite's `synchronous` for commits that must survive a crash, and for those that may not.
SYNCED, UNSYNCED = "FULL", "NORMAL"


class SQLiteJobStore:
    def __init__(
        self, path: Path, ttl_s: float, *, owner: str, lease_s: float, run: str | None = None
    ) -> None:
        self.shared = run is not None
        self.ttl_s = ttl_s
        # Every owner of this run starts so (`run_owner`): another is an earlier run's.
        self._run_prefix = None if run is None else run_owner(run, "")
        self.owner = owner if run is None else run_owner(run, owner)
        self.lease_s = lease_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            # Each commit waits for the disk (fsync): a job answered 202 is on it, and so is
            # every end recorded. `_unsynced` relaxes it for the writes a crash may lose.
            self._db.execute(f"PRAGMA synchronous={SYNCED}")
            self.upgraded_from = migrate_sqlite(self._db)
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    def create(
        self,
        *,
        model: str,
        prompt: str,
        seconds: str,
        size: str,
        settings: str | None = None,
        remixed_from: str | None = None,
        tenant: str | None = None,
    ) -> VideoJob:
        job_id = f"video_{secrets.token_hex(16)}"
        now = time.time()
        # One statement: the next seq is read and used atomically.
        self._db.execute(
            "INSERT INTO videos (id, status, progress, created_at, model, prompt, seconds, size, seq, "
            "settings, remixed_from, owner, lease_expires_at, tenant) "
            "SELECT ?, 'queued', 0, ?, ?, ?, ?, ?, COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ? FROM videos",
            (
                job_id,
                int(now),
                model,
                prompt,
                seconds,
                size,
                settings,
                remixed_from,
                self.owner,
                now + self.lease_s,
                tenant,
            ),
        )
        job = self.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    def get(self, job_id: str, tenant: str | None = None) -> VideoJob | None:
        where, args = _of(tenant, "id = ?", job_id)
        row = self._db.execute(f"SELECT {JOB_COLUMNS} FROM videos WHERE {where}", args).fetchone()
        return None if row is None else VideoJob(*row)

    def exists(self, job_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM videos WHERE id = ?", (job_id,)).fetchone() is not None

    def page(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"], tenant: str | None = None
    ) -> tuple[list[VideoJob], bool]:
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where, args = _of(tenant)
        if after is not None:
            cursor = self._db.execute(f"SELECT seq FROM videos WHERE {where} AND id = ?", (*args, after))
            row = cursor.fetchone()
            if row is None:
                raise KeyError(after)
            where, args = f"{where} AND seq {op} ?", (*args, row[0])
        rows = self._db.execute(
            f"SELECT {JOB_COLUMNS} FROM videos WHERE {where} ORDER BY seq {direction} LIMIT ?",
            (*args, limit + 1),
        ).fetchall()
        return [VideoJob(*row) for row in rows[:limit]], len(rows) > limit

    def mark_running(self, job_id: str) -> None:
        self._unsynced(
            "UPDATE videos SET status = 'in_progress' WHERE id = ? AND status = 'queued'", (job_id,)
        )

    def set_progress(self, job_id: str, progress: int) -> None:
        self._unsynced(
            "UPDATE videos SET progress = ? WHERE id = ? AND status = 'in_progress'", (progress, job_id)
        )

    def _unsynced(self, sql: str, args: tuple[object, ...]) -> None:
        """A job's state on its way (running, its progress), committed without waiting for the
        disk: a crash may lose it, as it loses the job itself (failed at the next start), and
        the next synced commit makes it durable with its own (the WAL is written in order;
        WAL at synchronous=NORMAL stays consistent). On a loaded machine each wait was 1.4-15
        ms of the store's one thread, in front of the polls and of the job's end."""
        self._db.execute(f"PRAGMA synchronous={UNSYNCED}")
        try:
            self._db.execute(sql, args)
        finally:
            self._db.execute(f"PRAGMA synchronous={SYNCED}")

    def complete(self, job_id: str) -> bool:
        now = int(time.time())
        cursor = self._db.execute(
            "UPDATE videos SET status = 'completed', progress = 100, completed_at = ?, expires_at = ? "
            f"WHERE id = ? AND {_UNFINISHED}",
            (now, now + int(self.ttl_s), job_id),
        )
        return cursor.rowcount > 0

    def fail(self, job_id: str, code: str, message: str) -> bool:
        return bool(self._fail_where("id = ?", (job_id,), code, message))

    def delete(self, job_id: str) -> bool:
        return self._db.execute("DELETE FROM videos WHERE id = ?", (job_id,)).rowcount > 0

    def take_expired(self) -> list[str]:
        rows = self._db.execute(
            "DELETE FROM videos WHERE expires_at IS NOT NULL AND expires_at <= ? RETURNING id",
            (int(time.time()),),
        ).fetchall()
        return [row[0] for row in rows]

    def renew_leases(self) -> set[str]:
        rows = self._db.execute(
            f"UPDATE videos SET lease_expires_at = ? WHERE owner = ? AND {_UNFINISHED} RETURNING id",
            (time.time() + self.lease_s, self.owner),
        ).fetchall()
        return {row[0] for row in rows}

    def fail_abandoned(self) -> list[str]:
        return self._fail_where(
            # No lease: written by a version without leases, whose server is gone.
            "(lease_expires_at IS NULL OR lease_expires_at < ?)",
            (time.time(),),
            SERVER_LOST,
            "the server running this video stopped before it was finished; create it again",
        )

    def fail_interrupted(self) -> list[str]:
        # Only this server uses the file: whatever is unfinished and not of its own run (all
        # of it, with one process) is its last run's.
        earlier = self._fail_where(
            *self._not_this_run(),
            "server_restarted",
            "the server stopped before this video was finished; create it again",
        )
        if self.shared:  # the siblings' jobs are theirs to finish: a dead one's, once its lease lapsed
            return earlier + self.fail_abandoned()
        return earlier

    def _not_this_run(self) -> tuple[str, tuple[object, ...]]:
        """The condition on `owner` of a row written by no process of this run."""
        if self._run_prefix is None:
            return "1 = 1", ()
        return "(owner IS NULL OR substr(owner, 1, ?) != ?)", (len(self._run_prefix), self._run_prefix)

    def _fail_where(self, condition: str, args: tuple[object, ...], code: str, message: str) -> list[str]:
        now = int(time.time())
        cursor = self._db.execute(
            "UPDATE videos SET status = 'failed', completed_at = ?, expires_at = ?, error_code = ?, "
            f"error_message = ? WHERE {_UNFINISHED} AND {condition} RETURNING id",
            (now, now + int(self.ttl_s), code, message, *args),
        )
        return [str(row[0]) for row in cursor.fetchall()]

    # Idempotency keys.

    def claim_key(self, key: str, fingerprint: str, window_s: float, stale_s: float) -> KeyRecord | None:
        while True:  # again if the earlier use is released between the two statements
            now = time.time()
            self._db.execute(
                "DELETE FROM idempotency_keys WHERE key = ? AND "
                "(expires_at <= ? OR (video_id IS NULL AND response IS NULL AND claimed_at <= ?))",
                (key, now, now - stale_s),
            )
            claimed = self._db.execute(
                "INSERT INTO idempotency_keys (key, fingerprint, claimed_at, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (key) DO NOTHING RETURNING key",
                (key, fingerprint, now, now + window_s),
            ).fetchone()
            if claimed is not None:
                return None
            row = self._db.execute(
                "SELECT fingerprint, video_id, response FROM idempotency_keys WHERE key = ?", (key,)
            ).fetchone()
            if row is not None:
                return KeyRecord(*row)

    def bind_key(self, key: str, video_id: str) -> None:
        self._db.execute("UPDATE idempotency_keys SET video_id = ? WHERE key = ?", (video_id, key))

    def bind_response(self, key: str, response: str) -> None:
        self._db.execute("UPDATE idempotency_keys SET response = ? WHERE key = ?", (response, key))

    def release_key(self, key: str) -> None:
        self._db.execute(
            "DELETE FROM idempotency_keys WHERE key = ? AND video_id IS NULL AND response IS NULL", (key,)
        )

    def purge_keys(self) -> int:
        return self._db.execute("DELETE FROM idempotency_keys WHERE expires_at <= ?", (time.time(),)).rowcount

    # Webhook deliveries.

    def add_delivery(self, delivery: PendingDelivery) -> None:
        self._db.execute(
            f"INSERT INTO webhook_deliveries ({DELIVERY_COLUMNS}, owner, lease_expires_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (*_fields(delivery), self.owner, time.time() + self.lease_s),
        )

    def record_attempts(self, event_id: str, url: str, attempts: int) -> None:
        self._db.execute(
            "UPDATE webhook_deliveries SET attempts = ? WHERE event_id = ? AND url = ?",
            (attempts, event_id, url),
        )

    def end_delivery(self, event_id: str, url: str) -> None:
        self._db.execute("DELETE FROM webhook_deliveries WHERE event_id = ? AND url = ?", (event_id, url))

    def keep_deliveries(self) -> list[PendingDelivery]:
        lease = time.time() + self.lease_s
        self._db.execute(
            "UPDATE webhook_deliveries SET lease_expires_at = ? WHERE owner = ?", (lease, self.owner)
        )
        # Only this server uses the file: another owner is a previous process of it, or, of
        # this run, a sibling API process, whose deliveries are taken once its lease lapsed.
        earlier, args = self._not_this_run()
        rows = self._db.execute(
            "UPDATE webhook_deliveries SET owner = ?, lease_expires_at = ? "
            f"WHERE owner IS NULL OR (owner != ? AND ({earlier} OR lease_expires_at < ?)) "
            f"RETURNING {DELIVERY_COLUMNS}",
            (self.owner, lease, self.owner, *args, time.time()),
        ).fetchall()
        return [PendingDelivery(*row) for row in rows]

    def release_deliveries(self) -> int:
        return self._db.execute(
            "UPDATE webhook_deliveries SET owner = NULL, lease_expires_at = 0 WHERE owner = ?", (self.owner,)
        ).rowcount


def run_owner(run: str, owner: str) -> str:
    """An owner of the run `run`: the run, then the process (`server_identity`)."""
    return f"{run}/{owner}"


def _of(tenant: str | None, condition: str = "1 = 1", *args: object) -> tuple[str, tuple[object, ...]]:
    """`condition` on the rows `tenant` sees (None: every row) and its arguments."""
    if tenant is None:
        return condition, args
    return f"{condition} AND tenant = ?", (*args, tenant)


def _fields(delivery: PendingDelivery) -> tuple[object, ...]:
    return (
        delivery.event_id,
        delivery.url,
        delivery.event_type,
        delivery.created_at,
        delivery.data_id,
        delivery.attempts,
        delivery.signer,
    )
