"""Open the job store the settings name: PostgreSQL with `--database-url`, else SQLite."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from server.jobs.model import JobStore, JobStoreUnavailableError

__all__ = ["JobStoreUnavailableError", "check_database", "open_job_store", "redacted", "server_identity"]


def server_identity() -> str:
    """Who owns the jobs this process runs: host and pid for people, a token so a reused pid
    on another start is never mistaken for the dead process."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def redacted(url: str) -> str:
    """The URL without its password (it goes into logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def open_job_store(
    database_url: str | None,
    sqlite_path: Path,
    ttl_s: float,
    *,
    lease_s: float,
    owner: str | None = None,
    run: str | None = None,
) -> JobStore:
    """`run`: the API processes of one server's run use the SQLite file (`SQLiteJobStore`)."""
    owner = owner or server_identity()
    if database_url is None:
        from server.jobs.sqlite import SQLiteJobStore

        return SQLiteJobStore(sqlite_path, ttl_s, owner=owner, lease_s=lease_s, run=run)
    try:
        import psycopg

        from server.jobs.postgres import PostgresJobStore
    except ImportError as exc:
        raise JobStoreUnavailableError(
            f"--database-url needs PostgreSQL support: install diffbatch[postgres] ({exc})"
        ) from None
    try:
        return PostgresJobStore(database_url, ttl_s, owner=owner, lease_s=lease_s)
    except psycopg.Error as exc:
        raise JobStoreUnavailableError(_cannot_use(database_url, exc)) from None


def check_database(url: str) -> None:
    """At start-up, before anything loads: `JobStoreUnavailableError` (one line, naming
    the flag) unless PostgreSQL support is installed and `url` accepts a connection."""
    try:
        import psycopg

        from server.jobs.postgres import connect
    except ImportError as exc:
        raise JobStoreUnavailableError(
            f"--database-url needs PostgreSQL support: install diffbatch[postgres] ({exc})"
        ) from None
    try:
        connect(url).close()
    except psycopg.Error as exc:
        raise JobStoreUnavailableError(_cannot_use(url, exc)) from None


def _cannot_use(url: str, exc: Exception) -> str:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return f"--database-url: cannot use {redacted(url)}: {reason}"
