"""Video jobs' state while their requests run: a job is in_progress once its batch starts,
then at its denoising progress. The engine's observer (`engine.core.stats.EngineObserver`) for
the jobs `VideoService` follows; it writes to the job store from the engine's loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from engine.outputs import DecodeRecord, ForwardRecord
from engine.request import RequestBatch
from server.jobs.model import JobStore

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class VideoProgress:
    """The job of each followed request, and its state recorded as the engine reports it."""

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self._job_of_request: dict[str, str] = {}

    def follow(self, request_id: str, job_id: str) -> None:
        self._job_of_request[request_id] = job_id

    def forget(self, request_id: str) -> None:
        self._job_of_request.pop(request_id, None)

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        for request_id in batch.request_ids:
            job_id = self._job_of_request.get(request_id)
            if job_id is not None:
                best_effort(self._store.mark_running, job_id)

    def on_forward(self, record: ForwardRecord) -> None:
        pass

    def on_decode(self, record: DecodeRecord) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        # Denoising is most of a video's time; 99 at most until the MP4 is written.
        progress = min(99, done * 100 // max(total, 1))
        for request_id in request_ids:
            job_id = self._job_of_request.get(request_id)
            if job_id is not None:
                best_effort(self._store.set_progress, job_id, progress)


def best_effort(call: Callable[..., _T], *args: object) -> _T | None:
    """A job's state on its way (in progress, progress): called from the engine's loop, which
    a database hiccup must not stop; the next update, or the job's end, says it again."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not record or read a video job's state: %s", exc)
        return None
