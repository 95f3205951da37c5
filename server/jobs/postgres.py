"""The shared job store: a PostgreSQL database several servers use at once (`--database-url`).

Every statement is one short autocommit round trip, made in the job store's thread like
SQLite's (`server/jobs/offloop.py`; no pool: one server makes a few per video). Leases are
in the database's own clock, so the servers' clocks need not agree. A job is run only by the server that wrote
its row; the others read it, delete it, and fail it once its lease has run out.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import psycopg

from server.jobs.migrations import migrate_postgres
from server.jobs.model import (
    DELIVERY_COLUMNS,
    JOB_COLUMNS,
    SERVER_LOST,
    JobStoreUnavailableError,
    KeyRecord,
    PendingDelivery,
    VideoJob,
)

_UNFINISHED = "status IN ('queued', 'in_progress')"
_NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
# A statement that takes longer than this means the database is in trouble: fail the call
# (an HTTP 5xx) rather than hold the store's thread.
STATEMENT_TIMEOUT_MS = 5000
CONNECT_TIMEOUT_S = 5


def connect(url: str) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(
        url,
        autocommit=True,
        connect_timeout=CONNECT_TIMEOUT_S,
        options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
        application_name="diffbatch",
        # A database gone silent (a network partition sends no reset) would otherwise hold
        # the store's thread for the kernel's TCP timeout: give up within seconds instead.
        tcp_user_timeout=STATEMENT_TIMEOUT_MS,
        keepalives=1,
        keepalives_idle=5,
        keepalives_interval=2,
        keepalives_count=3,
    )


class PostgresJobStore:
    shared = True

    def __init__(self, url: str, ttl_s: float, *, owner: str, lease_s: float) -> None:
        self.ttl_s = ttl_s
        self.owner = owner
        self.lease_s = lease_s
        self._url = url
        self._conn = connect(url)
        try:
            self.upgraded_from = migrate_postgres(self._conn)
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        self._conn.close()

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> psycopg.Cursor[tuple[Any, ...]]:
        try:
            if self._conn.closed:  # lost earlier (a database restart): connect again
                self._conn = connect(self._url)
            return self._conn.execute(sql, args)
        except psycopg.OperationalError as exc:  # unreachable, or a statement past its timeout
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise JobStoreUnavailableError(f"the job database cannot be reached: {reason}") from exc

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
        row = self._run(
            "INSERT INTO videos (id, status, progress, created_at, model, prompt, seconds, size, "
            "settings, remixed_from, owner, lease_expires_at, tenant) "
            f"VALUES (%s, 'queued', 0, FLOOR({_NOW}), %s, %s, %s, %s, %s, %s, %s, {_NOW} + %s, %s) "
            f"RETURNING {JOB_COLUMNS}",
            (
                f"video_{secrets.token_hex(16)}",
                model,
                prompt,
                seconds,
                size,
                settings,
                remixed_from,
                self.owner,
                self.lease_s,
                tenant,
            ),
        ).fetchone()
        assert row is not None
        return VideoJob(*row)

    def get(self, job_id: str, tenant: str | None = None) -> VideoJob | None:
        where, args = _of(tenant, "id = %s", job_id)
        row = self._run(f"SELECT {JOB_COLUMNS} FROM videos WHERE {where}", args).fetchone()
        return None if row is None else VideoJob(*row)

    def exists(self, job_id: str) -> bool:
        return self._run("SELECT 1 FROM videos WHERE id = %s", (job_id,)).fetchone() is not None

    def page(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"], tenant: str | None = None
    ) -> tuple[list[VideoJob], bool]:
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where, args = _of(tenant)
        if after is not None:
            row = self._run(f"SELECT seq FROM videos WHERE {where} AND id = %s", (*args, after)).fetchone()
            if row is None:
                raise KeyError(after)
            where, args = f"{where} AND seq {op} %s", (*args, row[0])
        rows = self._run(
            f"SELECT {JOB_COLUMNS} FROM videos WHERE {where} ORDER BY seq {direction} LIMIT %s",
            (*args, limit + 1),
        ).fetchall()
        return [VideoJob(*row) for row in rows[:limit]], len(rows) > limit

    def mark_running(self, job_id: str) -> None:
        self._run("UPDATE videos SET status = 'in_progress' WHERE id = %s AND status = 'queued'", (job_id,))

    def set_progress(self, job_id: str, progress: int) -> None:
        self._run(
            "UPDATE videos SET progress = %s WHERE id = %s AND status = 'in_progress'", (progress, job_id)
        )

    def complete(self, job_id: str) -> bool:
        cursor = self._run(
            f"UPDATE videos SET status = 'completed', progress = 100, completed_at = FLOOR({_NOW}), "
            f"expires_at = FLOOR({_NOW}) + %s WHERE id = %s AND {_UNFINISHED}",
            (int(self.ttl_s), job_id),
        )
        return cursor.rowcount > 0

    def fail(self, job_id: str, code: str, message: str) -> bool:
        return bool(self._fail_where("id = %s", (job_id,), code, message))

    def delete(self, job_id: str) -> bool:
        return self._run("DELETE FROM videos WHERE id = %s", (job_id,)).rowcount > 0

    def take_expired(self) -> list[str]:
        # DELETE ... RETURNING hands each row to one server only, however many purge at once.
        rows = self._run(
            f"DELETE FROM videos WHERE expires_at IS NOT NULL AND expires_at <= {_NOW} RETURNING id"
        ).fetchall()
        return [row[0] for row in rows]

    def renew_leases(self) -> set[str]:
        rows = self._run(
            f"UPDATE videos SET lease_expires_at = {_NOW} + %s WHERE owner = %s AND {_UNFINISHED} "
            "RETURNING id",
            (self.lease_s, self.owner),
        ).fetchall()
        return {row[0] for row in rows}

    def fail_abandoned(self) -> list[str]:
        # Each row is failed by one server: UPDATE takes its row lock, and the other's
        # UPDATE then finds it no longer unfinished.
        return self._fail_where(
            # No lease: written by a version without leases, whose server is gone.
            f"(lease_expires_at IS NULL OR lease_expires_at < {_NOW})",
            (),
            SERVER_LOST,
            "the server running this video stopped before it was finished (its lease ran out); "
            "create it again",
        )

    def fail_interrupted(self) -> list[str]:
        # Other servers' jobs are theirs to finish: only lapsed leases are abandoned.
        return self.fail_abandoned()

    def _fail_where(self, condition: str, args: tuple[Any, ...], code: str, message: str) -> list[str]:
        cursor = self._run(
            f"UPDATE videos SET status = 'failed', completed_at = FLOOR({_NOW}), "
            f"expires_at = FLOOR({_NOW}) + %s, error_code = %s, error_message = %s "
            f"WHERE {_UNFINISHED} AND {condition} RETURNING id",
            (int(self.ttl_s), code, message, *args),
        )
        return [str(row[0]) for row in cursor.fetchall()]

    # Idempotency keys (the primary key decides between servers that claim one at once).

    def claim_key(self, key: str, fingerprint: str, window_s: float, stale_s: float) -> KeyRecord | None:
        while True:  # again if the earlier use is released between the two statements
            self._run(
                f"DELETE FROM idempotency_keys WHERE key = %s AND (expires_at <= {_NOW} "
                f"OR (video_id IS NULL AND response IS NULL AND claimed_at <= {_NOW} - %s))",
                (key, stale_s),
            )
            claimed = self._run(
                "INSERT INTO idempotency_keys (key, fingerprint, claimed_at, expires_at) "
                f"VALUES (%s, %s, {_NOW}, {_NOW} + %s) ON CONFLICT (key) DO NOTHING RETURNING key",
                (key, fingerprint, window_s),
            ).fetchone()
            if claimed is not None:
                return None
            row = self._run(
                "SELECT fingerprint, video_id, response FROM idempotency_keys WHERE key = %s", (key,)
            ).fetchone()
            if row is not None:
                return KeyRecord(*row)

    def bind_key(self, key: str, video_id: str) -> None:
        self._run("UPDATE idempotency_keys SET video_id = %s WHERE key = %s", (video_id, key))

    def bind_response(self, key: str, response: str) -> None:
        self._run("UPDATE idempotency_keys SET response = %s WHERE key = %s", (response, key))

    def release_key(self, key: str) -> None:
        self._run(
            "DELETE FROM idempotency_keys WHERE key = %s AND video_id IS NULL AND response IS NULL", (key,)
        )

    def purge_keys(self) -> int:
        return self._run(f"DELETE FROM idempotency_keys WHERE expires_at <= {_NOW}").rowcount

    # Webhook deliveries (an UPDATE takes the row lock: an abandoned one goes to one server).

    def add_delivery(self, delivery: PendingDelivery) -> None:
        d = delivery
        self._run(
            f"INSERT INTO webhook_deliveries ({DELIVERY_COLUMNS}, owner, lease_expires_at) "
            f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s, {_NOW} + %s) ON CONFLICT DO NOTHING",
            (
                d.event_id,
                d.url,
                d.event_type,
                d.created_at,
                d.data_id,
                d.attempts,
                d.signer,
                self.owner,
                self.lease_s,
            ),
        )

    def record_attempts(self, event_id: str, url: str, attempts: int) -> None:
        self._run(
            "UPDATE webhook_deliveries SET attempts = %s WHERE event_id = %s AND url = %s",
            (attempts, event_id, url),
        )

    def end_delivery(self, event_id: str, url: str) -> None:
        self._run("DELETE FROM webhook_deliveries WHERE event_id = %s AND url = %s", (event_id, url))

    def keep_deliveries(self) -> list[PendingDelivery]:
        self._run(
            f"UPDATE webhook_deliveries SET lease_expires_at = {_NOW} + %s WHERE owner = %s",
            (self.lease_s, self.owner),
        )
        rows = self._run(
            f"UPDATE webhook_deliveries SET owner = %s, lease_expires_at = {_NOW} + %s "
            f"WHERE owner IS NULL OR lease_expires_at < {_NOW} RETURNING {DELIVERY_COLUMNS}",
            (self.owner, self.lease_s),
        ).fetchall()
        return [PendingDelivery(*row) for row in rows]

    def release_deliveries(self) -> int:
        return self._run(
            "UPDATE webhook_deliveries SET owner = NULL, lease_expires_at = 0 WHERE owner = %s", (self.owner,)
        ).rowcount


def _of(tenant: str | None, condition: str = "TRUE", *args: Any) -> tuple[str, tuple[Any, ...]]:
    """`condition` on the rows `tenant` sees (None: every row) and its arguments."""
    if tenant is None:
        return condition, args
    return f"{condition} AND tenant = %s", (*args, tenant)
