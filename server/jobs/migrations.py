"""The job tables' schema, versioned: each store upgrades an older database in place at open.

`diffbatch_schema` holds the version a database is at; a database without it was written
before versions were kept (schema 1, or older: a table from before remix lacks two columns).
Each step runs once, in the transaction that records it; a database newer than this code
is refused rather than misread.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import psycopg

# The video table as the first release created it (and as servers without PostgreSQL
# support still do): schema 1.
VIDEOS_V1 = """
CREATE TABLE IF NOT EXISTS videos (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    seconds TEXT NOT NULL,
    size TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    seq INTEGER NOT NULL,
    settings TEXT,
    remixed_from TEXT
)
"""
# Columns schema 1 gained after its first release (remix), added to an older table.
_REMIX_COLUMNS = {"settings": "TEXT", "remixed_from": "TEXT"}

_VERSION_TABLE = "CREATE TABLE IF NOT EXISTS diffbatch_schema (version INTEGER NOT NULL)"


class SchemaTooNewError(RuntimeError):
    pass


def _sqlite_v1(db: sqlite3.Connection) -> None:
    db.execute(VIDEOS_V1)
    known = {row[1] for row in db.execute("PRAGMA table_info(videos)")}
    for column, kind in _REMIX_COLUMNS.items():
        if column not in known:  # a table from before remix: keep its rows
            db.execute(f"ALTER TABLE videos ADD COLUMN {column} {kind}")


def _sqlite_v2(db: sqlite3.Connection) -> None:
    # Leases: which server runs a job and until when it vouches for it (unix seconds).
    db.execute("ALTER TABLE videos ADD COLUMN owner TEXT")
    db.execute("ALTER TABLE videos ADD COLUMN lease_expires_at REAL")
    db.execute("CREATE INDEX IF NOT EXISTS videos_by_seq ON videos (seq)")


# Idempotency keys: which request (fingerprint) first used a key, and the video it made.
_KEYS = """
CREATE TABLE idempotency_keys (
    key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    video_id TEXT,
    claimed_at {real} NOT NULL,
    expires_at {real} NOT NULL
)
"""


def _sqlite_v3(db: sqlite3.Connection) -> None:
    db.execute(_KEYS.format(real="REAL"))


# What an image request with a key answered (its JSON body; '' when too large to keep).
_KEY_RESPONSE = "ALTER TABLE idempotency_keys ADD COLUMN response TEXT"


def _sqlite_v4(db: sqlite3.Connection) -> None:
    db.execute(_KEY_RESPONSE)


# Webhook deliveries not yet made, leased (owner, expiry) like the jobs so that another
# server resumes those of one that stopped.
_DELIVERIES = """
CREATE TABLE webhook_deliveries (
    event_id TEXT NOT NULL,
    url TEXT NOT NULL,
    event_type TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    data_id TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    owner TEXT,
    lease_expires_at {real},
    PRIMARY KEY (event_id, url)
)
"""


def _sqlite_v5(db: sqlite3.Connection) -> None:
    db.execute(_DELIVERIES.format(real="REAL"))


# Tenants (issue 39): the keyed digest of the API key that created a job (`ApiKey.tenant`),
# NULL for jobs of a server without keys and for rows written before tenants (those only
# servers without keys and admin keys see). Listing one tenant's jobs in order reads the index.
_TENANT = "ALTER TABLE videos ADD COLUMN tenant TEXT"
_TENANT_INDEX = "CREATE INDEX videos_by_tenant ON videos (tenant, seq)"


def _sqlite_v6(db: sqlite3.Connection) -> None:
    db.execute(_TENANT)
    db.execute(_TENANT_INDEX)


# Who signs each delivery: '' the server (--webhook-secret; what rows before it meant),
# else the tenant digest of the API key whose webhook_secret does. Never the secret itself.
_DELIVERY_SIGNER = "ALTER TABLE webhook_deliveries ADD COLUMN signer TEXT NOT NULL DEFAULT ''"


def _sqlite_v7(db: sqlite3.Connection) -> None:
    db.execute(_DELIVERY_SIGNER)


SQLITE_STEPS: Sequence[Callable[[sqlite3.Connection], None]] = (
    _sqlite_v1,
    _sqlite_v2,
    _sqlite_v3,
    _sqlite_v4,
    _sqlite_v5,
    _sqlite_v6,
    _sqlite_v7,
)

POSTGRES_STEPS: Sequence[Sequence[str]] = (
    (VIDEOS_V1,),
    (
        # Leases (in the database's clock, so servers' clocks need not agree), times past
        # 2038, and a sequence for the creation order: MAX(seq) + 1 races between servers.
        "ALTER TABLE videos ADD COLUMN owner TEXT, ADD COLUMN lease_expires_at DOUBLE PRECISION, "
        "ALTER COLUMN created_at TYPE BIGINT, ALTER COLUMN completed_at TYPE BIGINT, "
        "ALTER COLUMN expires_at TYPE BIGINT, ALTER COLUMN seq TYPE BIGINT",
        "CREATE SEQUENCE videos_seq OWNED BY videos.seq",
        "SELECT setval('videos_seq', COALESCE(MAX(seq), 0) + 1, false) FROM videos",
        "ALTER TABLE videos ALTER COLUMN seq SET DEFAULT nextval('videos_seq')",
        "CREATE INDEX videos_by_seq ON videos (seq)",
        "CREATE INDEX videos_unfinished ON videos (owner) WHERE status IN ('queued', 'in_progress')",
        "CREATE INDEX videos_by_expiry ON videos (expires_at)",
    ),
    (_KEYS.format(real="DOUBLE PRECISION"),),
    (_KEY_RESPONSE,),
    (_DELIVERIES.format(real="DOUBLE PRECISION"),),
    (_TENANT, _TENANT_INDEX),
    (_DELIVERY_SIGNER,),
)

LATEST = len(SQLITE_STEPS)
assert len(POSTGRES_STEPS) == LATEST


def _check_version(found: int | None) -> int:
    current = found or 0
    if current > LATEST:
        raise SchemaTooNewError(
            f"the job database is at schema version {current}, newer than this diffbatch "
            f"understands ({LATEST}); run a newer diffbatch or use another database"
        )
    return current


def migrate_sqlite(db: sqlite3.Connection) -> int:
    """Bring `db` (autocommit mode) to the latest schema; returns the version it was at."""
    db.execute("BEGIN IMMEDIATE")  # one process migrates; another waits, then finds it done
    try:
        db.execute(_VERSION_TABLE)
        current = _check_version(db.execute("SELECT MAX(version) FROM diffbatch_schema").fetchone()[0])
        for version, step in enumerate(SQLITE_STEPS, start=1):
            if version > current:
                step(db)
        db.execute("DELETE FROM diffbatch_schema")
        db.execute("INSERT INTO diffbatch_schema (version) VALUES (?)", (LATEST,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return current


# pg_advisory_xact_lock's key: servers starting together migrate one after the other.
_MIGRATION_LOCK = 0x64696666  # "diff"


def migrate_postgres(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    """Bring the database to the latest schema; returns the version it was at."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(_VERSION_TABLE)
        row = conn.execute("SELECT MAX(version) FROM diffbatch_schema").fetchone()
        current = _check_version(cast("int | None", row[0]) if row is not None else None)
        for version, statements in enumerate(POSTGRES_STEPS, start=1):
            if version > current:
                for statement in statements:
                    conn.execute(statement)
        conn.execute("DELETE FROM diffbatch_schema")
        conn.execute("INSERT INTO diffbatch_schema (version) VALUES (%s)", (LATEST,))
    return current
