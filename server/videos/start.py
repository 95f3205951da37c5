"""Video jobs at start-up: open the job store (failing the jobs the last shutdown cut short),
start the webhook sender, and the `VideoService` that runs the jobs, observing the engine.
Without a readable store the server still starts (it may serve images only) and the video
endpoints say why they cannot answer."""

from __future__ import annotations

import logging

from server.jobs.files import VideoFiles
from server.jobs.offloop import AsyncJobStore
from server.jobs.opening import JobStoreUnavailableError, open_job_store, redacted
from server.state import AppState
from server.videos.service import VideoService
from server.webhooks import VideoEvents, WebhookSender, signing_secrets

logger = logging.getLogger(__name__)


async def start_videos(state: AppState) -> tuple[AsyncJobStore | None, WebhookSender | None]:
    """Open and start what video jobs need, setting `state.videos` (None without a store);
    the store and the webhook sender, for the lifespan to close at the end."""
    store, interrupted = await _open_video_store(state)
    sender = _webhook_sender(state, store)
    if store is not None:
        state.videos = VideoService(
            store,
            VideoFiles(state.outputs),
            lambda model: state.engine_for(model, "video", "POST /v1/videos"),
            state.models,
            timeout_s=state.settings.video_timeout_s,
            lease_s=state.settings.job_lease_s,
            events=VideoEvents(sender, state.settings.webhook_url),
            key_limits=state.key_limits,
            traceparent=state.tracing.traceparent,
        )
        state.engine.observers.append(state.videos.progress)
        await state.videos.lost(interrupted)  # announced like jobs failed by a lapsed lease
        state.videos.start()
    return store, sender


async def _open_video_store(state: AppState) -> tuple[AsyncJobStore | None, list[str]]:
    """The video job table and the jobs it failed as it opened (cut short by the last
    shutdown, or a dead server's); if it cannot be read, the server still starts (it may
    serve images only) and the video endpoints say why they cannot answer."""
    settings = state.settings
    directory = settings.output_dir / "videos"
    store: AsyncJobStore | None = None
    try:
        store = await AsyncJobStore.open(
            lambda: open_job_store(
                settings.database_url,
                directory / "videos.sqlite3",
                settings.video_ttl_s,
                lease_s=settings.job_lease_s,
                run=state.server_run,
            ),
            settings.database_timeout_s,
        )
        interrupted = await store.fail_interrupted()
    except Exception as exc:  # noqa: BLE001 - sqlite3.DatabaseError, psycopg.Error, a newer schema
        if isinstance(exc, JobStoreUnavailableError):
            state.videos_error = str(exc)
        else:
            where = redacted(settings.database_url) if settings.database_url else f"in {directory}"
            state.videos_error = f"the video job database {where} cannot be read ({exc}); move it away"
        logger.error("%s: video endpoints will answer 503", state.videos_error)
        if store is not None:
            await store.close()
        return None, []
    if interrupted:
        logger.warning("%d video jobs were cut short by the last shutdown; marked failed", len(interrupted))
    return store, interrupted


def _webhook_sender(state: AppState, store: AsyncJobStore | None) -> WebhookSender | None:
    """The sender, its deliveries kept in the job store (resumed after a restart, or by
    another server sharing it) and the abandoned ones taken over every third of a lease.
    None when nothing could sign an event (no --webhook-secret, no key's webhook_secret)."""
    settings = state.settings
    secrets = signing_secrets(settings.webhook_secret, settings.api_key_entries, state.tenants)
    if not secrets:
        return None
    sender = WebhookSender(
        secrets,
        state.metrics,
        attempts=settings.webhook_attempts,
        backoff_s=settings.webhook_backoff_s,
        timeout_s=settings.webhook_timeout_s,
        journal=store,
    )
    sender.start(every_s=settings.job_lease_s / 3)
    return sender
