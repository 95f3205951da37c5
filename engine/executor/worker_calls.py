"""The runs a `ProcessExecutor` has sent its worker and not yet heard back about: each a
future that the worker's `Done` or `Failed` settles, or that fails when its answer cannot
be read or the worker dies. Used on the event loop only."""

from __future__ import annotations

import asyncio

from engine.executor.worker_loop import Done, Failed
from engine.outputs import BatchOutput


class Calls:
    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future[BatchOutput]] = {}
        self._last_id = 0

    def open(self, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Future[BatchOutput]]:
        """A new run's id (it names the run in messages both ways) and its future."""
        self._last_id += 1
        future: asyncio.Future[BatchOutput] = loop.create_future()
        self._futures[self._last_id] = future
        return self._last_id, future

    def close(self, call_id: int) -> None:
        """Forget a run that was never sent."""
        self._futures.pop(call_id, None)

    def settle(self, message: Done | Failed) -> None:
        future = self._futures.pop(message.call_id, None)
        if future is None or future.done():
            return
        if isinstance(message, Done):
            future.set_result(message.output)
        else:
            future.set_exception(message.error)

    def fail(self, call_id: int | None, error: Exception) -> None:
        """Fail run `call_id` with `error` (None: every run in flight)."""
        ids = list(self._futures) if call_id is None else [call_id]
        for future in (self._futures.pop(i, None) for i in ids):
            if future is not None and not future.done():
                future.set_exception(error)
