"""OpenAI's Videos API: create a job, poll it, list, delete, download the MP4, a thumbnail
or a spritesheet."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from engine.request import InvalidRequestError
from server import control_inputs
from server.control_inputs import ControlInputs
from server.errors import ERROR_RESPONSES, APIError
from server.idempotency import fingerprint, idempotency_key, once
from server.jobs.model import VideoJob
from server.protocol import MAX_NAME_CHARS
from server.state import (
    AppState,
    State,
    caller_key,
    caller_priority,
    caller_timeout,
    form_fields,
    request_id_of,
    require_api_key,
    require_media_type,
)
from server.uploads import no_files_api, pixels_digest, read_data_url, read_image, single_part
from server.video import MEDIA_TYPE
from server.video_protocol import (
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoList,
    VideoObject,
    VideoRemixRequest,
)

# Video ids are "video_" and 32 hex digits; a longer cursor is not one (and is not echoed).
MAX_ID_CHARS = 64

router = APIRouter(prefix="/v1/videos", dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)


@router.post("")
async def create_video(request: Request, response: Response, state: State) -> VideoObject:
    body, reference, control = await _parse_create(request, state)
    body = body.model_copy(update={"priority": caller_priority(request, body.priority)})
    _check_webhook_url(body.webhook_url, state)
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
            ),
        )
    except InvalidRequestError as exc:
        if exc.param == "input_images":  # this endpoint calls the input images by other names
            name = "reference_images" if control.references else "input_reference"
            raise APIError(400, f"{name}: {exc}", param=name) from None
        raise
    return _video_object(job, response)


@router.post("/{video_id}/remix")
async def remix_video(
    video_id: str, body: VideoRemixRequest, request: Request, response: Response, state: State
) -> VideoObject:
    """A new video from a completed one: its settings and seed, a new prompt."""
    state.check_accepting()
    source = _job(state, video_id)
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
            ),
        )
    except InvalidRequestError as exc:
        if exc.param == "prompt":
            raise
        # Everything but the prompt is the source video's (its settings, its input image).
        raise APIError(
            400, f"video {video_id} cannot be remixed by the model served now: {exc}", param="video_id"
        ) from None
    return _video_object(job, response)


@router.get("")
async def list_videos(
    state: State,
    after: Annotated[str | None, Query(max_length=MAX_ID_CHARS)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoList:
    try:
        jobs, has_more = state.video_service().store.page(after=after, limit=limit, order=order)
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
async def retrieve_video(video_id: str, response: Response, state: State) -> VideoObject:
    return _video_object(_job(state, video_id), response)


@router.delete("/{video_id}")
async def delete_video(video_id: str, state: State) -> VideoDeleted:
    _job(state, video_id)
    await state.video_service().delete(video_id)
    return VideoDeleted(id=video_id)


@router.get(
    "/{video_id}/content",
    response_class=Response,
    responses={200: {"content": {MEDIA_TYPE: {}, "image/png": {}}}, 307: {"description": "a presigned URL"}},
)
async def download_video(
    video_id: str, state: State, variant: Literal["video", "thumbnail", "spritesheet"] = "video"
) -> Response:
    """The MP4; or a PNG of its first frame (`thumbnail`), or of up to 16 evenly spaced
    frames in a grid of at most 4 x 4 (`spritesheet`). With `--output-url`, a redirect to a
    presigned URL of the bucket's object (or the object itself with `--proxy-content`)."""
    job = _job(state, video_id)
    if job.status != "completed":
        raise APIError(404, f"video {video_id} has no content: its status is {job.status}", code="not_ready")
    service = state.video_service()
    service.download_started(video_id)  # a DELETE now leaves the file for this response
    content = await asyncio.to_thread(service.files.response, video_id, variant)
    if content is None:
        raise APIError(404, f"video {video_id} has no {variant} file any more", code="not_found")
    return content


_REFERENCE_FIELDS = ("input_reference", "input_reference[image_url]", "input_reference[file_id]")


async def _parse_create(
    request: Request, state: AppState
) -> tuple[VideoCreateRequest, tuple[Any, ...], ControlInputs]:
    """The body, the decoded `input_reference` image if one was uploaded (image-to-video), and
    a controlled video's inputs (`server.control_inputs`).

    The official client always sends multipart/form-data; url-encoded forms and JSON work too.
    """
    fields: dict[str, Any]
    reference: tuple[Any, ...] = ()
    control = ControlInputs()
    max_bytes, max_pixels = int(state.settings.max_body_mb * 1024 * 1024), state.settings.max_upload_pixels
    content_type = require_media_type(
        request,
        ("multipart/form-data", "application/x-www-form-urlencoded", "application/json"),
        "multipart/form-data (as the official client sends it) or application/json",
    )
    if content_type != "application/json":
        async with request.form() as form:  # closes uploaded files on the way out
            _check_model_field(form.get("model"), state)
            # The official client sends {"image_url": ...} as the field input_reference[image_url].
            given = single_part(form, "input_reference", "input_reference[image_url]")
            if form.get("input_reference[file_id]") is not None:
                raise no_files_api("input_reference")
            if isinstance(given, UploadFile):
                reference = (
                    await read_image(given, "input_reference", max_bytes=max_bytes, max_pixels=max_pixels),
                )
            elif given is not None:  # a data URL in a text field
                reference = (await read_data_url(given, "input_reference", max_bytes, max_pixels),)
            control = await control_inputs.from_form(form, max_bytes, max_pixels)
            fields = form_fields(form, (*_REFERENCE_FIELDS, *control_inputs.CONTROL_FIELDS))
            for key, value in fields.items():
                if not isinstance(value, str):
                    raise APIError(
                        400, "only input_reference, video, mask and reference_images may be files", param=key
                    )
    else:
        try:
            fields = await request.json()
        except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
            raise APIError(400, "the request body must be JSON or a form (multipart/form-data)") from None
        if not isinstance(fields, dict):
            raise APIError(400, "the request body must be a JSON object")
        _check_model_field(fields.get("model"), state)
        given = fields.pop("input_reference", None)
        if given is not None:  # a data URL, or {"image_url": data URL} as OpenAI's API allows
            reference = (await read_data_url(given, "input_reference", max_bytes, max_pixels),)
        control = await control_inputs.from_json(fields, max_bytes, max_pixels)
    try:
        return VideoCreateRequest.model_validate(fields), reference, control
    except ValidationError as exc:
        # Reported like every other validation error: 400, with the field named.
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _check_model_field(model: object, state: AppState) -> None:
    """404 for a model this server does not serve, before any uploaded video or image is
    decoded (seconds of work for a control video). A `model` that is not text, or too long
    to be a name, is left to the body's own validation (400 naming it, never echoing it)."""
    if model is None or (isinstance(model, str) and len(model) <= MAX_NAME_CHARS):
        state.check_model(model)


def _check_webhook_url(url: str | None, state: AppState) -> None:
    """A request's own webhook_url makes this server call that URL: only http(s) URLs of
    hosts the operator allowed (the server could otherwise be pointed at internal services)."""
    if url is None:
        return
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        parts, host = None, ""
    if parts is None or parts.scheme not in ("http", "https") or not host:
        raise APIError(400, "webhook_url must be an http:// or https:// URL", param="webhook_url")
    if not state.settings.webhook_host_allowed(host):
        allowed = state.settings.allowed_webhook_host_list
        raise APIError(
            400,
            f"webhook_url: host {host!r} is not one this server sends webhooks to"
            + (f" ({', '.join(allowed)})" if allowed else " (it allows none: --allowed-webhook-hosts)"),
            param="webhook_url",
        )


def _job(state: AppState, video_id: str) -> VideoJob:
    job = state.video_service().store.get(video_id)
    if job is None:
        raise APIError(404, f"no video with id {video_id!r}", param="video_id", code="not_found")
    return job


# Bounds of the polling interval suggested to clients (openai-poll-after-ms).
POLL_MIN_MS, POLL_MAX_MS, POLL_QUEUED_MS = 250, 5000, 1000


def poll_after_ms(job: VideoJob, now: float) -> int | None:
    """When a client polling the job should ask again (the official client honours it):
    a quarter of the time its progress says is left, within bounds; None once it has ended."""
    if job.status == "queued":
        return POLL_QUEUED_MS
    if job.status != "in_progress":
        return None
    elapsed_ms = max(0.0, now - job.created_at) * 1000
    if job.progress <= 0:
        return POLL_QUEUED_MS
    remaining_ms = elapsed_ms * (100 - job.progress) / job.progress
    return int(min(POLL_MAX_MS, max(POLL_MIN_MS, remaining_ms / 4)))


def _video_object(job: VideoJob, response: Response | None = None) -> VideoObject:
    """The job as OpenAI describes it; with `response`, also when to poll it next."""
    if response is not None and (wait_ms := poll_after_ms(job, time.time())) is not None:
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
