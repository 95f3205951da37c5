"""Every job store call off the event loop, within a deadline (`AsyncJobStore`).

The stores (`server/jobs/sqlite.py`, `server/jobs/postgres.py`) are synchronous, and a call
blocks for as long as its database takes: 5 s on an SQLite file another process holds
locked, and for ever on a PostgreSQL that is frozen but connected (a stopped backend, a
frozen VM, a pooler waiting for a connection: no error, no reset, and no statement timeout,
which the stopped server itself would enforce). Made on the event loop, such a call froze
the whole server, `/health` included.

Here each call runs in the store's own thread — one, because a database connection must not
be used by two threads at once — and its caller waits at most `timeout_s`, its wait for the
thread included, then gets `JobStoreUnavailableError` (a 503 `job_store_unavailable`). A call
that timed out still holds the thread until the database answers; meanwhile each later
call waits for it only until its own deadline (never longer: a frozen database costs a
request the deadline, not a queue), a queued call whose caller stopped waiting never runs,
and one that ran too late is undone where it made something (`undo`). Calls are not failed
at once behind a stuck one: the moment it answers, the next call must find the store.
`StoreHealth` keeps what `/health` says of the store, without asking it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from server.jobs.model import JobStore, JobStoreUnavailableError, KeyRecord, PendingDelivery, VideoJob

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(slots=True)
class StoreHealth:
    """The store as its last call found it: answering, or unavailable since when and why."""

    unavailable_since: float | None = None  # time.time() of the first failure of this outage
    reason: str | None = None

    def failed(self, reason: str) -> None:
        if self.unavailable_since is None:
            self.unavailable_since = time.time()
            logger.warning("the job store is unavailable: %s", reason)
        self.reason = reason

    def answered(self) -> None:
        if self.unavailable_since is not None:
            logger.info(
                "the job store answers again after %.0f s unavailable", time.time() - self.unavailable_since
            )
        self.unavailable_since = self.reason = None

    def as_dict(self) -> dict[str, object]:
        if self.unavailable_since is None:
            return {"status": "ok"}
        return {"status": "unavailable", "since": int(self.unavailable_since), "reason": self.reason}


class _StoreThread:
    """One daemon thread running the store's calls in order. A daemon: a call stuck on a
    frozen database must not keep the process from exiting at shutdown."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.busy_since: float | None = None  # monotonic start of the call running now
        self._thread = threading.Thread(target=self._serve, name="diffbatch-job-store", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._calls.put((call, future))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            if not future.set_running_or_notify_cancel():  # its caller stopped waiting
                continue
            self.busy_since = time.monotonic()
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            finally:
                self.busy_since = None


class _Call:
    """One store call; `abandon` marks its caller gone (a late result is then undone)."""

    def __init__(self, call: Callable[[], _T], undo: Callable[[_T], object] | None) -> None:
        self._call = call
        self._undo = undo
        self._lock = threading.Lock()
        self._abandoned = False

    def run(self) -> Any:
        result = self._call()
        with self._lock:
            late = self._abandoned
        if late and self._undo is not None:
            try:
                self._undo(result)
            except Exception as exc:  # noqa: BLE001 - best effort: the database just came back
                logger.warning("could not undo a job store call that answered too late: %s", exc)
        return result

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True


class AsyncJobStore:
    """A `JobStore` whose calls are awaited: run in the store's thread, within `timeout_s`."""

    def __init__(self, store: JobStore, thread: _StoreThread, timeout_s: float) -> None:
        self._store = store
        self._thread = thread
        self.timeout_s = timeout_s
        self.health = StoreHealth()
        self._background: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, opener: Callable[[], JobStore], timeout_s: float) -> AsyncJobStore:
        """Open the store in its own thread (the connection is used there only). Opening is
        not bounded by the deadline: migrations may take longer, before anything is served."""
        thread = _StoreThread()
        try:
            store = await asyncio.wrap_future(thread.submit(opener))
        except BaseException:
            thread.stop()
            raise
        return cls(store, thread, timeout_s)

    @property
    def ttl_s(self) -> float:
        return self._store.ttl_s

    @property
    def shared(self) -> bool:
        return self._store.shared

    @property
    def upgraded_from(self) -> int:
        return self._store.upgraded_from

    def status(self) -> dict[str, object]:
        """What `/health` says of the store, without asking it: the last call's outcome, or
        a call stuck past the deadline (before any caller has timed out on it)."""
        busy_since = self._thread.busy_since
        if busy_since is not None and time.monotonic() - busy_since > self.timeout_s:
            self.health.failed(f"the job database has not answered for {time.monotonic() - busy_since:.0f} s")
        return self.health.as_dict()

    async def call(
        self, call: Callable[[JobStore], _T], *, undo: Callable[[JobStore, _T], object] | None = None
    ) -> _T:
        """`call(store)` in the store's thread, within the deadline (`JobStoreUnavailableError`
        past it). `undo(store, result)` runs if the call finishes after its caller gave up
        (timed out or cancelled)."""
        store = self._store
        job = _Call(lambda: call(store), None if undo is None else lambda result: undo(store, result))
        try:
            async with asyncio.timeout(self.timeout_s):  # cancels a queued call: it never runs
                result: _T = await asyncio.wrap_future(self._thread.submit(job.run))
        except asyncio.CancelledError:  # its caller went away: what it made is undone too
            job.abandon()
            raise
        except TimeoutError:
            job.abandon()
            reason = f"the job database did not answer within {self.timeout_s:g} s (--database-timeout-s)"
            self.health.failed(reason)
            raise JobStoreUnavailableError(reason) from None
        except JobStoreUnavailableError as exc:
            self.health.failed(str(exc))
            raise
        except sqlite3.OperationalError as exc:
            if not _busy(exc):
                raise
            reason = f"the job database is locked by another process ({exc})"
            self.health.failed(reason)
            raise JobStoreUnavailableError(reason) from exc
        self.health.answered()
        return result

    def later(self, call: Callable[[JobStore], object], what: str) -> None:
        """Best effort, not awaited (from the engine's observers, which cannot await): a
        job's state on its way, which the next update or the job's end says again."""

        async def run() -> None:
            try:
                await self.call(call)
            except JobStoreUnavailableError as exc:  # said once an outage (`StoreHealth`)
                logger.debug("could not record %s: %s", what, exc)
            except Exception as exc:  # noqa: BLE001
                logger.warning("could not record %s: %s", what, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        try:
            await self.call(lambda store: store.close())
        except JobStoreUnavailableError as exc:
            logger.warning("the job store could not be closed: %s", exc)
        finally:
            self._thread.stop()

    # The `JobStore` calls, awaited.

    async def create(
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
        def create(store: JobStore) -> VideoJob:
            return store.create(
                model=model,
                prompt=prompt,
                seconds=seconds,
                size=size,
                settings=settings,
                remixed_from=remixed_from,
                tenant=tenant,
            )

        # A row written after its request gave up would be a queued job nobody runs, kept
        # alive by this server's lease renewals: failed at once instead.
        return await self.call(create, undo=_fail_late_job)

    async def get(self, job_id: str, tenant: str | None = None) -> VideoJob | None:
        return await self.call(lambda store: store.get(job_id, tenant=tenant))

    async def exists(self, job_id: str) -> bool:
        return await self.call(lambda store: store.exists(job_id))

    async def page(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"], tenant: str | None = None
    ) -> tuple[list[VideoJob], bool]:
        return await self.call(lambda store: store.page(after=after, limit=limit, order=order, tenant=tenant))

    async def complete(self, job_id: str) -> bool:
        return await self.call(lambda store: store.complete(job_id))

    async def fail(self, job_id: str, code: str, message: str) -> bool:
        return await self.call(lambda store: store.fail(job_id, code, message))

    async def delete(self, job_id: str) -> bool:
        return await self.call(lambda store: store.delete(job_id))

    async def take_expired(self) -> list[str]:
        return await self.call(lambda store: store.take_expired())

    async def renew_leases(self) -> set[str]:
        return await self.call(lambda store: store.renew_leases())

    async def fail_abandoned(self) -> list[str]:
        return await self.call(lambda store: store.fail_abandoned())

    async def fail_interrupted(self) -> list[str]:
        return await self.call(lambda store: store.fail_interrupted())

    async def claim_key(
        self, key: str, fingerprint: str, window_s: float, stale_s: float
    ) -> KeyRecord | None:
        def release_if_claimed(store: JobStore, first: KeyRecord | None) -> None:
            if first is None:  # claimed too late: free it for the client's retry
                store.release_key(key)

        return await self.call(
            lambda store: store.claim_key(key, fingerprint, window_s, stale_s), undo=release_if_claimed
        )

    async def bind_key(self, key: str, video_id: str) -> None:
        await self.call(lambda store: store.bind_key(key, video_id))

    async def bind_response(self, key: str, response: str) -> None:
        await self.call(lambda store: store.bind_response(key, response))

    async def release_key(self, key: str) -> None:
        await self.call(lambda store: store.release_key(key))

    async def purge_keys(self) -> int:
        return await self.call(lambda store: store.purge_keys())

    async def add_delivery(self, delivery: PendingDelivery) -> None:
        await self.call(lambda store: store.add_delivery(delivery))

    async def record_attempts(self, event_id: str, url: str, attempts: int) -> None:
        await self.call(lambda store: store.record_attempts(event_id, url, attempts))

    async def end_delivery(self, event_id: str, url: str) -> None:
        await self.call(lambda store: store.end_delivery(event_id, url))

    async def keep_deliveries(self) -> list[PendingDelivery]:
        return await self.call(lambda store: store.keep_deliveries())

    async def release_deliveries(self) -> int:
        return await self.call(lambda store: store.release_deliveries())


def _fail_late_job(store: JobStore, job: VideoJob) -> None:
    store.fail(
        job.id,
        "job_store_unavailable",
        "the job database answered too late to start this video; nothing ran: create it again",
    )


def _busy(exc: sqlite3.OperationalError) -> bool:
    """SQLite's way of saying another connection holds the file (its busy timeout passed)."""
    return "locked" in str(exc) or "busy" in str(exc)
