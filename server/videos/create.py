"""The body of `POST /v1/videos` parsed: the official client's multipart form, a url-encoded
form or JSON; the `input_reference` image (image-to-video) and a controlled video's inputs
(`server.videos.control_inputs`) decoded, after the model is known to be served."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from server.errors import APIError
from server.protocol import MAX_NAME_CHARS
from server.state import AppState, form_fields, require_media_type
from server.uploads import no_files_api, read_data_url, read_image, single_part
from server.videos import control_inputs
from server.videos.control_inputs import ControlInputs
from server.videos.protocol import VideoCreateRequest

_REFERENCE_FIELDS = ("input_reference", "input_reference[image_url]", "input_reference[file_id]")


async def parse_create(
    request: Request, state: AppState
) -> tuple[VideoCreateRequest, tuple[Any, ...], ControlInputs]:
    """The body, the decoded `input_reference` image if one was uploaded (image-to-video), and
    a controlled video's inputs (`server.videos.control_inputs`).

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
    is_form = content_type != "application/json"
    if is_form:
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
        # A form's fields are strings, converted; JSON's are taken as typed (`server.protocol`).
        body = VideoCreateRequest.model_validate(fields, strict=False if is_form else None)
        return body, reference, control
    except ValidationError as exc:
        # Reported like every other validation error: 400, with the field named.
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _check_model_field(model: object, state: AppState) -> None:
    """404 for a model this server does not serve, before any uploaded video or image is
    decoded (seconds of work for a control video). A `model` that is not text, or too long
    to be a name, is left to the body's own validation (400 naming it, never echoing it)."""
    if model is None or (isinstance(model, str) and len(model) <= MAX_NAME_CHARS):
        state.check_model(model)
