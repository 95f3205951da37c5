"""Keeping this server's video jobs alive in a store other servers may share.

Three times a lease, the keeper renews the leases of the jobs this server runs, fails the
jobs whose server stopped renewing theirs (any server may: the first to look does it), and
hands back the jobs of this server that are no longer its to run — deleted or failed by
another server meanwhile — so they are cancelled here instead of running to no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from server.jobs.model import JobStoreUnavailableError
from server.jobs.offloop import AsyncJobStore

logger = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self,
        store: AsyncJobStore,
        lease_s: float,
        running: Callable[[], set[str]],
        gone: Callable[[set[str]], None],
        lost: Callable[[list[str]], Awaitable[None]],
    ) -> None:
        self._store = store
        self._lease_s = lease_s
        self._running = running  # the jobs this server is running now
        self._gone = gone  # told which of them are no longer this server's to run
        self._lost = lost  # told which jobs of dead servers it failed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep(), name="diffbatch-video-leases")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            try:
                await self.renew_once()
            except JobStoreUnavailableError:  # logged by the store, once an outage
                pass  # the next round may still be within the lease
            except Exception:
                logger.exception("could not renew the video jobs' leases; trying again")

    async def renew_once(self) -> None:
        ours = self._running()  # taken first: a job created during the renewal is not gone
        alive = await self._store.renew_leases()
        if ours - alive:
            self._gone(ours - alive)
        lost = await self._store.fail_abandoned()
        if lost:
            logger.warning(
                "%d video jobs failed: the server running them stopped renewing their lease", len(lost)
            )
            await self._lost(lost)
