"""Video jobs in motion: admit each job's request to the engine, follow it, store its MP4.

`create` admits the request before the job exists, so bad input, a full queue or a model
that is not ready fail the HTTP call itself; after that the job's fate is recorded in the
`JobStore` (queued → in_progress when its batch starts → completed | failed). While it
runs, this server renews its lease; a job deleted or failed by another server sharing the
store meanwhile is cancelled here at the next renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from engine.core.handle import RequestHandle
from engine.core.service import EngineService
from engine.request import GenerationRequest, RequestOutput
from server.api_keys import ApiKey
from server.errors import APIError, from_engine_error
from server.jobs.files import VideoFiles, orphans
from server.jobs.leases import LeaseKeeper
from server.jobs.model import JobStore, JobStoreUnavailableError, VideoJob
from server.jobs.offloop import AsyncJobStore
from server.key_limits import KeyLimits, KeyLimitsService, tenant_of
from server.models import ServedModelList
from server.videos.control_inputs import ControlInputs
from server.videos.output import read_reference, write_outputs
from server.videos.polling import JobDurations
from server.videos.progress import VideoProgress
from server.videos.protocol import VideoCreateRequest
from server.videos.remix import check_still_served, own_webhook_of, remix_request, settings_of
from server.webhooks import OwnWebhook, VideoEvents, webhook_signer

logger = logging.getLogger(__name__)

# How long a download keeps a deleted job's files: the time a response takes to open them.
DOWNLOAD_OPEN_S = 60.0
# Between two tries to record a job's end while the job store is unavailable: doubling from
# the first, up to the last (a store back from an outage hears of the job within seconds).
END_RETRY_S = (0.5, 5.0)


# The engine of a request's `model` (loaded if need be; 404 / 400 naming `model`).
EngineLookup = Callable[[str | None], Awaitable[EngineService]]


class VideoService:
    def __init__(
        self,
        store: AsyncJobStore,
        files: VideoFiles,
        engines: EngineLookup,
        models: ServedModelList,
        *,
        timeout_s: float | None = None,
        lease_s: float = 30.0,
        events: VideoEvents | None = None,
        key_limits: KeyLimitsService | None = None,
        traceparent: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store = store
        # The creating HTTP request's span, for its engine spans (`server.tracing`).
        self._traceparent = traceparent
        self._key_limits = key_limits or KeyLimits()
        self.files = files
        self._leases = LeaseKeeper(
            store, lease_s, running=lambda: set(self._tasks), gone=self._gone_elsewhere, lost=self.lost
        )
        self._engines = engines
        self._models = models
        self._timeout_s = timeout_s
        self._events = events or VideoEvents()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # The engine's observer of these jobs (`server.app` adds it to the engine's).
        self.progress = VideoProgress(store)
        # How long each model's videos take here, for the polls' suggested interval.
        self.durations = JobDurations()
        self._downloads: dict[str, float] = {}  # job id -> when its last download began
        self._writing: set[str] = set()  # jobs whose MP4 and thumbnail are being written
        self._ending: set[str] = set()  # jobs whose end is being recorded (retried in an outage)
        self._stopping = asyncio.Event()

    async def create(
        self,
        body: VideoCreateRequest,
        input_images: tuple[Any, ...] = (),
        request_id: str | None = None,
        remixed_from: str | None = None,
        control: ControlInputs | None = None,
        *,
        timeout_s: float | None = None,
        key: ApiKey | None = None,
        tenant: str | None = None,
    ) -> VideoJob:
        """Admit the job's request (within `key`'s limits, `server.key_limits`) and follow it
        as a job of `tenant` (`server.tenants`); `timeout_s` (the caller's deadline) replaces
        the server's."""
        lora = self._models.lora_for(body.model, body.lora)
        params = body.sampling_params(
            fps=body.fps,
            duration_s=body.seconds,
            lora=lora,
            guidance_scale_2=body.guidance_scale_2,
            conditioning_scale=body.conditioning_scale,
        )
        control = control or ControlInputs()
        generation = GenerationRequest.create(
            body.prompt,
            params,
            timeout_s=self._timeout_s if timeout_s is None else timeout_s,
            input_images=input_images,
            request_id=request_id,
            control_video=control.video,
            mask=control.mask,
            traceparent=self._traceparent(),
            **tenant_of(key),
        )
        # The key's limits before its model loads or its inputs are prepared (no load, no
        # eviction, no decode for a key past them).
        release = await self._key_limits.admit(key)
        try:
            engine = await self._engines(body.model)
            handle = self._key_limits.submit(engine, await engine.prepare_inputs(generation), key, release)
        except BaseException:
            release()
            raise
        request = handle.request
        own_webhook = (
            None if body.webhook_url is None else OwnWebhook(body.webhook_url, webhook_signer(tenant))
        )
        self.progress.expect(request.request_id)  # its batch may start while the row is written
        try:
            job = await self.store.create(
                model=body.model or self._models.default.base,
                prompt=body.prompt,
                seconds=f"{body.seconds:g}",
                size=f"{request.params.width}x{request.params.height}",
                settings=settings_of(
                    body, request.params.seed, bool(request.input_images), control.given, own_webhook
                ),
                remixed_from=remixed_from,
                tenant=tenant,
            )
        except BaseException as exc:
            handle.abort()  # nobody could ever learn its fate
            self.progress.forget(request.request_id)
            if not isinstance(exc, Exception) or isinstance(exc, JobStoreUnavailableError):
                raise  # the store is down (a 503 job_store_unavailable), or the caller left
            logger.exception("could not record a video job; its request %s is aborted", request.request_id)
            raise APIError(
                500,
                "the video job could not be recorded (is the output directory full?); nothing was queued",
                type="server_error",
                code="storage_error",
            ) from exc
        self.progress.follow(request.request_id, job.id)
        self._events.expect(job.id, own_webhook)
        # A remix sent no model or lora: an adapter that fails is its source video's.
        lora_param = "video_id" if remixed_from is not None else body.lora_param()
        task = asyncio.create_task(self._run(job, handle, lora_param), name=f"video-{job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(lambda _: self._forget(job.id, request.request_id))
        logger.info("video %s queued as request %s", job.id, request.request_id)
        return job

    async def remix(
        self,
        source: VideoJob,
        prompt: str,
        request_id: str | None = None,
        priority: int = 0,
        *,
        timeout_s: float | None = None,
        key: ApiKey | None = None,
        tenant: str | None = None,
    ) -> VideoJob:
        """A new job with `source`'s settings and seed and a new prompt (OpenAI's remix), at
        the remixing caller's `priority` and deadline (`timeout_s`; None: the server's), sent
        with its API `key`: the remixing `tenant`'s job."""
        body, with_reference = remix_request(source, prompt)
        body = body.model_copy(update={"priority": priority})
        check_still_served(self._models, source.id, body)
        reference: tuple[Any, ...] = ()
        if with_reference:
            try:
                reference = (await asyncio.to_thread(read_reference, self.files, source.id),)
            except FileNotFoundError:
                raise APIError(
                    400, f"video {source.id} no longer has its input_reference image", param="video_id"
                ) from None
        return await self.create(
            body,
            input_images=reference,
            request_id=request_id,
            remixed_from=source.id,
            timeout_s=timeout_s,
            key=key,
            tenant=tenant,
        )

    async def delete(self, job_id: str) -> bool:
        """Cancel the job if it is queued or running (it never runs, or its result is
        dropped), then remove its row and files (those a download has just opened stay
        until `purge_orphans`: an open file keeps its contents, a path being opened does not)."""
        task = self._tasks.get(job_id)
        if task is not None and not self._finishing(job_id):
            task.cancel()
        # A job whose files are being written finishes writing and then, finding its row
        # gone, removes them itself (cancelling it would leave the writing thread going).
        deleted = await self.store.delete(job_id)
        if not self.files.outputs.opens_late or job_id not in self._recent_downloads():
            await asyncio.to_thread(self.files.remove, job_id)
        return deleted

    async def purge_expired(self) -> int:
        """Remove the expired jobs' rows, then their files (a bucket's objects too)."""
        expired = await self.store.take_expired()
        for job_id in expired:
            await asyncio.to_thread(self.files.remove, job_id)
        await self.store.purge_keys()  # idempotency keys past their window go with them
        return len(expired)

    async def purge_orphans(self) -> int:
        # The store is asked in its own thread (its connection lives there), the files in another.
        settled = await asyncio.to_thread(self.files.settled, self.in_use())
        found = await self.store.call(lambda store: orphans(settled, store.exists))
        await asyncio.to_thread(self.files.outputs.delete, found)
        return len(found)

    def start(self) -> None:
        self._leases.start()

    def _finishing(self, job_id: str) -> bool:
        """A finished video: its files being written, or its end being recorded. Never
        cancelled: it finishes, and finding its row gone, removes its files itself (its
        renewal may also miss it for a moment once it has ended)."""
        return job_id in self._writing or job_id in self._ending

    def _gone_elsewhere(self, job_ids: set[str]) -> None:
        """Jobs another server deleted or failed: stop running them (a finished video being
        written finishes, then finds its row ended and removes its files)."""
        for job_id in job_ids:
            task = self._tasks.get(job_id)
            if task is not None and not self._finishing(job_id):
                logger.info("video %s was deleted or failed by another server; cancelling it here", job_id)
                task.cancel()

    async def lost(self, job_ids: list[str]) -> None:
        """Jobs of a server that died, which this one failed: announced from here, to the
        job's own webhook_url too (kept in its settings)."""
        for job_id in job_ids:
            try:
                job = await self.store.get(job_id)
            except JobStoreUnavailableError:
                job = None  # announced to the server's --webhook-url alone
            self._events.ended(job_id, "video.failed", own_webhook_of(job.settings if job else None))

    def download_started(self, job_id: str) -> None:
        self._downloads[job_id] = time.monotonic()

    def in_use(self) -> set[str]:
        """Jobs whose files must stay: running (being written) or just opened for download."""
        return set(self._tasks) | self._recent_downloads()

    def _recent_downloads(self) -> set[str]:
        # A response opens its file within moments of the route returning; after that the
        # open file survives an unlink.
        cutoff = time.monotonic() - DOWNLOAD_OPEN_S
        for job_id in [j for j, started in self._downloads.items() if started < cutoff]:
            del self._downloads[job_id]
        return set(self._downloads)

    async def stop(self) -> None:
        """At shutdown: jobs still queued or running end now, failed with a reason a client
        can read (rather than at the next start-up, which may never come). A finished video
        is kept: being written, or its completion being recorded (one last try)."""
        self._stopping.set()
        for job_id in list(self._tasks):
            if self._finishing(job_id):
                continue
            try:
                failed = await self.store.fail(
                    job_id,
                    "server_stopped",
                    "the server stopped before this video was finished; create it again",
                )
            except JobStoreUnavailableError:  # its lease runs out: another server fails it
                continue
            if failed:  # not if another server failed it already (its lease lapsed) or it was deleted
                self._events.ended(job_id, "video.failed")
        await self._leases.stop()
        tasks = list(self._tasks.values())
        for job_id, task in self._tasks.items():
            if not self._finishing(job_id):
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, job: VideoJob, handle: RequestHandle, lora_param: str) -> None:
        job_id = job.id
        # Its duration for the polls' interval (`JobDurations`): `created_at` is in whole
        # seconds, too coarse for a video of a tenth of one.
        started = time.monotonic()
        try:
            output = await handle.result()
            fps = handle.request.params.fps or 1
            reference = handle.request.input_images[0] if handle.request.input_images else None
            self._writing.add(job_id)
            try:
                await asyncio.to_thread(self._write_files, job_id, output, fps, reference)
            finally:
                self._writing.discard(job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is recorded on the job
            error = from_engine_error(exc, handle.request.params.lora, lora_param)
            logger.warning("video %s failed: %s", job_id, error.message)
            code = error.code or error.type
            ended = await self._record_end(
                job_id,
                "failed",
                lambda store: store.fail(job_id, code, error.message),
                lambda job: job.status == "failed" and job.error_code == code,
            )
            if ended == "ended":
                self._events.ended(job_id, "video.failed")
            return
        ended = await self._record_end(
            job_id, "completed", lambda store: store.complete(job_id), lambda job: job.status == "completed"
        )
        if ended == "gone":  # deleted meanwhile (failed by a restart: its files expire with it)
            await asyncio.to_thread(self.files.remove, job_id)
        elif ended == "ended":
            logger.info("video %s completed", job_id)
            self.durations.note(job.model, time.monotonic() - started)
            self._events.ended(job_id, "video.completed")

    async def _record_end(
        self,
        job_id: str,
        status: str,
        end: Callable[[JobStore], bool],
        mine: Callable[[VideoJob], bool],
    ) -> Literal["ended", "gone", "other"]:
        """Record the job's end (`end`): "ended" by this call, "gone" (deleted meanwhile) or
        "other" (ended elsewhere: failed by a restart or another server). While the store is
        unavailable the end is kept and tried again — a finished video must not be lost to an
        outage (its MP4 is written already) — until the job would have expired, or the server
        stops; its webhook is sent once it is recorded (a delivery is a row of the store too)."""
        give_up = time.monotonic() + self.store.ttl_s
        delay = END_RETRY_S[0]
        self._ending.add(job_id)
        try:
            while True:
                try:
                    if await self.store.call(end):
                        return "ended"
                    # Ended already: by an earlier try that answered after its deadline, or elsewhere.
                    job = await self.store.get(job_id)
                    return "gone" if job is None else "ended" if mine(job) else "other"
                except JobStoreUnavailableError as exc:
                    if self._stopping.is_set() or time.monotonic() + delay > give_up:
                        logger.error(
                            "video %s is %s, but the job store could not record it (%s); given up "
                            "(%s): the job will fail once its lease runs out",
                            job_id,
                            status,
                            exc,
                            "the server is stopping" if self._stopping.is_set() else "the video has expired",
                        )
                        return "other"
                    if delay == END_RETRY_S[0]:
                        logger.warning(
                            "video %s is %s, but the job store cannot record it now (%s); trying "
                            "again until it can",
                            job_id,
                            status,
                            exc,
                        )
                with contextlib.suppress(TimeoutError):  # a stop wakes it for one last try
                    await asyncio.wait_for(self._stopping.wait(), delay)
                delay = min(delay * 2, END_RETRY_S[1])
        finally:
            self._ending.discard(job_id)

    def _write_files(self, job_id: str, output: RequestOutput, fps: int, reference: Any | None) -> None:
        write_outputs(self.files, job_id, output, fps, reference)

    def _forget(self, job_id: str, request_id: str) -> None:
        self._tasks.pop(job_id, None)
        self.progress.forget(request_id)
        self._events.forget(job_id)
