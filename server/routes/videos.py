"""OpenAI's Videos API: create a job, poll it, list, delete, download the MP4, a thumbnail
or a spritesheet."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from engine.request import InvalidRequestError
from server.api_keys import ApiKey
from server.errors import ERROR_RESPONSES, APIError
from server.idempotency import fingerprint, idempotency_key, once
from server.jobs.model import VideoJob
from server.request_log import received
from server.state import (
    AppState,
    State,
    caller_key,
    caller_priority,
    caller_tenant,
    caller_timeout,
    caller_view,
    request_id_of,
    require_api_key,
)
from server.uploads import pixels_digest
from server.videos.create import parse_create
from server.videos.encoding import MEDIA_TYPE
from server.videos.polling import poll_after_ms
from server.videos.protocol import (
    VideoDeleted,
    VideoError,
    VideoList,
    VideoObject,
    VideoRemixRequest,
)
from server.webhook_urls import parse_webhook_url, webhook_host

# Video ids are "video_" and 32 hex digits; a longer cursor is not one (and is not echoed).
MAX_ID_CHARS = 64

router = APIRouter(prefix="/v1/videos", dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)


@router.post("")
async def create_video(request: Request, response: Response, state: State) -> VideoObject:
    body, reference, control = await parse_create(request, state)
    received(request, body.model, "POST /v1/videos")
    body = body.model_copy(update={"priority": caller_priority(request, body.priority)})
    _check_webhook_url(body.webhook_url, state, caller_key(request))
    state.check_accepting()
    await state.engine_for(body.model, "video", "POST /v1/videos")  # loaded; the service routes
    service = state.video_service()
    # A controlled video's references follow input_reference (Wan VACE takes both as references).
    images = (*reference, *control.references)
    inputs = (*images, *(array for array in (control.video, control.mask) if array is not None))
    # What the request asks for, parsed (its input images and videos as the pixels they decoded to).
    digest = fingerprint(body.model_dump_json(), pixels_digest(*inputs))
    try:
        job = await once(
            service.store,
            idempotency_key(request),
            digest,
            state.settings.idempotency_window_s,
            lambda: service.create(
                body,
                input_images=images,
                control=control,
                request_id=request_id_of(request),
                timeout_s=caller_timeout(request, state.settings.video_timeout_s, body.timeout),
                key=caller_key(request),
                tenant=caller_tenant(request),
            ),
        )
    except InvalidRequestError as exc:
        if exc.param == "input_images":  # this endpoint calls the input images by other names
            name = "reference_images" if control.references else "input_reference"
            raise APIError(400, f"{name}: {exc}", param=name) from None
        raise
    return _video_object(job, response, state)


@router.post("/{video_id}/remix")
async def remix_video(
    video_id: str, body: VideoRemixRequest, request: Request, response: Response, state: State
) -> VideoObject:
    """A new video from a completed one: its settings and seed, a new prompt."""
    state.check_accepting()
    source = await _job(state, video_id, request)
    service = state.video_service()
    try:
        job = await once(
            service.store,
            idempotency_key(request),
            fingerprint(video_id, body.prompt),
            state.settings.idempotency_window_s,
            lambda: service.remix(
                source,
                body.prompt,
                request_id=request_id_of(request),
                priority=caller_priority(request, None),
                timeout_s=caller_timeout(request, state.settings.video_timeout_s, None),
                key=caller_key(request),
                tenant=caller_tenant(request),
            ),
        )
    except InvalidRequestError as exc:
        if exc.param == "prompt":
            raise
        # Everything but the prompt is the source video's (its settings, its input image).
        raise APIError(
            400, f"video {video_id} cannot be remixed by the model served now: {exc}", param="video_id"
        ) from None
    return _video_object(job, response, state)


@router.get("")
async def list_videos(
    request: Request,
    state: State,
    after: Annotated[str | None, Query(max_length=MAX_ID_CHARS)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoList:
    try:
        store = state.video_service().store
        jobs, has_more = await store.page(after=after, limit=limit, order=order, tenant=caller_view(request))
    except KeyError:
        raise APIError(
            400,
            f"after: no video with id {after!r} (deleted, expired or never made), so there is no "
            "place to continue from; list again without after",
            param="after",
        ) from None
    data = [_video_object(job) for job in jobs]
    return VideoList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


@router.get("/{video_id}")
async def retrieve_video(video_id: str, request: Request, response: Response, state: State) -> VideoObject:
    return _video_object(await _job(state, video_id, request), response, state)


@router.delete("/{video_id}")
async def delete_video(video_id: str, request: Request, state: State) -> VideoDeleted:
    await _job(state, video_id, request)
    await state.video_service().delete(video_id)
    return VideoDeleted(id=video_id)


@router.get(
    "/{video_id}/content",
    response_class=Response,
    responses={200: {"content": {MEDIA_TYPE: {}, "image/png": {}}}, 307: {"description": "a presigned URL"}},
)
async def download_video(
    video_id: str,
    request: Request,
    state: State,
    variant: Literal["video", "thumbnail", "spritesheet"] = "video",
) -> Response:
    """The MP4; or a PNG of its first frame (`thumbnail`), or of up to 16 evenly spaced
    frames in a grid of at most 4 x 4 (`spritesheet`). With `--output-url`, a redirect to a
    presigned URL of the bucket's object (or the object itself with `--proxy-content`)."""
    job = await _job(state, video_id, request)
    if job.status != "completed":
        raise APIError(404, f"video {video_id} has no content: its status is {job.status}", code="not_ready")
    service = state.video_service()
    service.download_started(video_id)  # a DELETE now leaves the file for this response
    content = await asyncio.to_thread(service.files.response, video_id, variant)
    if content is None:
        raise APIError(404, f"video {video_id} has no {variant} file any more", code="not_found")
    return content


def _check_webhook_url(url: str | None, state: AppState, key: ApiKey | None) -> None:
    """A request's own webhook_url makes this server call that URL: only http(s) URLs of
    hosts the operator allowed (the server could otherwise be pointed at internal services),
    read as httpx will send to them, and signed with the caller's own secret (its key's
    webhook_secret; on a server without keys, --webhook-secret)."""
    if url is None:
        return
    try:
        host = webhook_host(parse_webhook_url(url))
    except ValueError as exc:
        raise APIError(400, f"webhook_url {exc}", param="webhook_url") from None
    if not state.settings.webhook_host_allowed(host):
        allowed = state.settings.allowed_webhook_host_list
        raise APIError(
            400,
            f"webhook_url: host {host!r} is not one this server sends webhooks to"
            + (f" ({', '.join(allowed)})" if allowed else " (it allows none: --allowed-webhook-hosts)"),
            param="webhook_url",
        )
    if key is not None and key.webhook_secret is None:
        raise APIError(
            400,
            f"webhook_url: this API key ({key.name}) has no webhook_secret to sign its events "
            "(the server's keys give it as KEY:webhook_secret=whsec_...)",
            param="webhook_url",
        )
    if key is None and state.settings.webhook_secret is None:
        raise APIError(
            400, "webhook_url: this server has no --webhook-secret to sign its events", param="webhook_url"
        )


async def _job(state: AppState, video_id: str, request: Request) -> VideoJob:
    """The caller's video: another tenant's is a 404 as one that does not exist (its id says
    nothing, not even that it exists)."""
    job = await state.video_service().store.get(video_id, tenant=caller_view(request))
    if job is None:
        raise APIError(404, f"no video with id {video_id!r}", param="video_id", code="not_found")
    return job


def _video_object(
    job: VideoJob, response: Response | None = None, state: AppState | None = None
) -> VideoObject:
    """The job as OpenAI describes it; with `response` and `state`, also when to poll it next
    (`server.videos.polling`)."""
    if response is not None and state is not None:
        typical_s = state.video_service().durations.typical_s(job.model)
        if (wait_ms := poll_after_ms(job, time.time(), typical_s)) is not None:
            response.headers["openai-poll-after-ms"] = str(wait_ms)
    error = None
    if job.error_code is not None:
        error = VideoError(code=job.error_code, message=job.error_message or "")
    return VideoObject(
        id=job.id,
        status=job.status,
        progress=job.progress,
        created_at=job.created_at,
        completed_at=job.completed_at,
        expires_at=job.expires_at,
        model=job.model,
        prompt=job.prompt,
        seconds=job.seconds,
        size=job.size,
        error=error,
        remixed_from_video_id=job.remixed_from,
    )
