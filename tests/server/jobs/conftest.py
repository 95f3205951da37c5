"""Every job-store test runs against both stores: SQLite in a file and a real PostgreSQL."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from server.jobs.model import JobStore
from server.jobs.opening import open_job_store


class OpenStore(Protocol):
    def __call__(self, *, owner: str = "a", lease_s: float = 3600, ttl_s: float = 3600) -> JobStore: ...


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def location(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str | None:
    """Where the stores of one test keep their rows: the database URL, or None for SQLite."""
    if store_kind == "sqlite":
        return None
    url: str = request.getfixturevalue("database_url")
    return url


@pytest.fixture
def open_store(location: str | None, tmp_path: Path) -> Iterator[OpenStore]:
    """Opens a store on the test's database (each call: another server, or a restart)."""
    opened: list[JobStore] = []

    def open_one(*, owner: str = "a", lease_s: float = 3600, ttl_s: float = 3600) -> JobStore:
        store = open_job_store(location, tmp_path / "videos.sqlite3", ttl_s, lease_s=lease_s, owner=owner)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        # One opened (and closed) in another thread: SQLite refuses to touch it from this one.
        with contextlib.suppress(sqlite3.ProgrammingError):
            store.close()
