"""OpenAI's Videos API: create a job, poll it, list, delete, download the MP4 or a thumbnail."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from engine.request import InvalidRequestError
from server.errors import ERROR_RESPONSES, APIError
from server.protocol import VideoCreateRequest, VideoDeleted, VideoError, VideoList, VideoObject
from server.state import AppState, State, form_fields, request_id_of, require_api_key, require_media_type
from server.uploads import read_image
from server.video import MEDIA_TYPE
from server.video_jobs import VideoJob

router = APIRouter(prefix="/v1/videos", dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)


@router.post("")
async def create_video(request: Request, state: State) -> VideoObject:
    body, reference = await _parse_create(request, state)
    state.check_accepting()
    state.check_model(body.model)
    state.check_modality("video", "POST /v1/videos")
    try:
        job = await state.video_service().create(
            body, input_images=reference, request_id=request_id_of(request)
        )
    except InvalidRequestError as exc:
        if exc.param == "input_images":  # this endpoint calls the input image input_reference
            raise APIError(400, f"input_reference: {exc}", param="input_reference") from None
        raise
    return _video_object(job)


@router.get("")
async def list_videos(
    state: State,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoList:
    jobs, has_more = state.video_service().store.page(after=after, limit=limit, order=order)
    data = [_video_object(job) for job in jobs]
    return VideoList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


@router.get("/{video_id}")
async def retrieve_video(video_id: str, state: State) -> VideoObject:
    return _video_object(_job(state, video_id))


@router.delete("/{video_id}")
async def delete_video(video_id: str, state: State) -> VideoDeleted:
    _job(state, video_id)
    state.video_service().delete(video_id)
    return VideoDeleted(id=video_id)


@router.get("/{video_id}/content")
async def download_video(
    video_id: str, state: State, variant: Literal["video", "thumbnail"] = "video"
) -> FileResponse:
    job = _job(state, video_id)
    if job.status != "completed":
        raise APIError(404, f"video {video_id} has no content: its status is {job.status}", code="not_ready")
    service = state.video_service()
    thumbnail = variant == "thumbnail"
    path = service.store.thumbnail_path(video_id) if thumbnail else service.store.video_path(video_id)
    if not path.is_file():
        raise APIError(404, f"video {video_id} has no {variant} file any more", code="not_found")
    service.download_started(video_id)  # a DELETE now leaves the file for this response
    if thumbnail:
        return FileResponse(path, media_type="image/png")
    return FileResponse(path, media_type=MEDIA_TYPE, filename=f"{video_id}.mp4")


async def _parse_create(request: Request, state: AppState) -> tuple[VideoCreateRequest, tuple[Any, ...]]:
    """The body, and the decoded `input_reference` image if one was uploaded (image-to-video).

    The official client always sends multipart/form-data; url-encoded forms and JSON work too.
    """
    fields: dict[str, Any]
    reference: tuple[Any, ...] = ()
    content_type = require_media_type(
        request,
        ("multipart/form-data", "application/x-www-form-urlencoded", "application/json"),
        "multipart/form-data (as the official client sends it) or application/json",
    )
    if content_type != "application/json":
        async with request.form() as form:  # closes uploaded files on the way out
            upload = form.get("input_reference")
            if isinstance(upload, UploadFile):
                image = await read_image(
                    upload,
                    "input_reference",
                    max_bytes=int(state.settings.max_body_mb * 1024 * 1024),
                    max_pixels=state.settings.max_upload_pixels,
                )
                reference = (image,)
            fields = form_fields(form, ("input_reference",))
            for key, value in fields.items():
                if not isinstance(value, str):
                    raise APIError(400, "only input_reference may be a file", param=key)
    else:
        try:
            fields = await request.json()
        except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
            raise APIError(400, "the request body must be JSON or a form (multipart/form-data)") from None
        if not isinstance(fields, dict):
            raise APIError(400, "the request body must be a JSON object")
    try:
        return VideoCreateRequest.model_validate(fields), reference
    except ValidationError as exc:
        # Reported like every other validation error: 400, with the field named.
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _job(state: AppState, video_id: str) -> VideoJob:
    job = state.video_service().store.get(video_id)
    if job is None:
        raise APIError(404, f"no video with id {video_id!r}", param="video_id", code="not_found")
    return job


def _video_object(job: VideoJob) -> VideoObject:
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
    )
