"""Video jobs' state while their requests run: a job is in_progress once its batch starts,
then at its denoising progress. The engine's observer (`engine.core.stats.EngineObserver`) for
the jobs `VideoService` follows; its writes go to the job store's thread, not awaited (the
engine's loop must not wait for a database)."""

from __future__ import annotations

from engine.core.stats import QuietObserver
from engine.request import RequestBatch
from server.jobs.model import JobStore
from server.jobs.offloop import AsyncJobStore


class VideoProgress(QuietObserver):
    """The job of each followed request, and its state recorded as the engine reports it."""

    def __init__(self, store: AsyncJobStore) -> None:
        self._store = store
        # None: the request is admitted and its row is being written (its id not known yet).
        self._job_of_request: dict[str, str | None] = {}
        self._started: set[str] = set()  # expected requests whose batch started before the row

    def expect(self, request_id: str) -> None:
        """The request is admitted; its job's row comes next (`follow`), and its batch may
        start while the row is written."""
        self._job_of_request[request_id] = None

    def follow(self, request_id: str, job_id: str) -> None:
        self._job_of_request[request_id] = job_id
        if request_id in self._started:
            self._started.discard(request_id)
            self._mark_running(job_id)

    def forget(self, request_id: str) -> None:
        self._job_of_request.pop(request_id, None)
        self._started.discard(request_id)

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        for request_id in batch.request_ids:
            if request_id not in self._job_of_request:
                continue
            job_id = self._job_of_request[request_id]
            if job_id is None:
                self._started.add(request_id)
            else:
                self._mark_running(job_id)

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        # Denoising is most of a video's time; 99 at most until the MP4 is written.
        progress = min(99, done * 100 // max(total, 1))
        for request_id in request_ids:
            job_id = self._job_of_request.get(request_id)
            if job_id is not None:
                self._set_progress(job_id, progress)

    def _set_progress(self, job_id: str, progress: int) -> None:
        def record(store: JobStore) -> None:
            store.set_progress(job_id, progress)

        self._store.later(record, "a video's progress")

    def _mark_running(self, job_id: str) -> None:
        def record(store: JobStore) -> None:
            store.mark_running(job_id)

        self._store.later(record, "that a video is running")
