"""Where image answers are encoded: a pool of threads, one per core, apart from asyncio's
default pool. The encoders release the GIL while they compress (`server.media`), so encodes
run in parallel with each other, the event loop and the pipeline's thread, and the
pipeline's thread never waits for one. Apart, because a queue of encodes in asyncio's
default pool would hold up the file and database calls that wait there."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class EncodingPool:
    def __init__(self, workers: int | None = None) -> None:
        # Threads start on first use: building the app starts none.
        self._threads = ThreadPoolExecutor(
            max_workers=workers or os.cpu_count() or 1, thread_name_prefix="diffbatch-encode"
        )

    async def run(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work(*args, **kwargs)` in the pool, awaited here."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, lambda: work(*args, **kwargs))

    def close(self) -> None:
        """No new work; what is running finishes (a request being answered is not cut off)."""
        self._threads.shutdown(wait=False, cancel_futures=False)
