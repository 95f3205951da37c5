"""The `controlnet` entries of a multipart form (`POST /v1/images/edits`), nested as Rack and
PHP nest form fields: `controlnet[0][name]`, `controlnet[0][image]` (a file part, or a data URL
or bare base64 as text), and optionally `controlnet[0][scale]`, `[start]` and `[end]`.

The index may be left empty, `controlnet[][name]`: that is how the official `openai` client
sends `extra_body={"controlnet": [{...}, {...}]}` in a form (brackets, entry after entry). An
entry then ends where one of its fields comes again (Rack's rule), which keeps each entry's
fields together as long as they are sent in order, as the client does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile

from engine.request import MAX_CONTROLNETS
from server.control_images import ControlEntry
from server.errors import APIError
from server.protocol import ControlSettings

PREFIX = "controlnet"
# controlnet[<index or nothing>][<field>]; a few digits bound the index before it is read.
_KEY = re.compile(r"^controlnet\[(\d{0,3})\]\[([a-z_]{1,16})\]$")
_HOW = (
    "send each ControlNet as form fields controlnet[0][name] and controlnet[0][image] (a file or "
    "a data URL), optionally controlnet[0][scale], controlnet[0][start] and controlnet[0][end]"
)


@dataclass(frozen=True)
class FormControls:
    """A form's ControlNet entries, and the form keys they came in (not the body's fields)."""

    entries: list[ControlEntry]
    keys: tuple[str, ...]


def form_controls(form: FormData) -> FormControls:
    """The form's `controlnet` entries in order, checked: 400 naming the part that is wrong."""
    parts = [(key, value) for key, value in form.multi_items() if key.startswith(PREFIX)]
    grouped = _grouped(parts)
    if len(grouped) > MAX_CONTROLNETS:
        raise APIError(400, f"at most {MAX_CONTROLNETS} controlnet entries per request", param=PREFIX)
    entries = [_entry(index, fields) for index, fields in enumerate(grouped)]
    return FormControls(entries, tuple(dict.fromkeys(key for key, _ in parts)))


def _grouped(parts: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Each entry's fields, by explicit index or, with empty brackets, in the order sent."""
    indexed: dict[int, dict[str, Any]] = {}
    listed: list[dict[str, Any]] = []
    for key, value in parts:
        match = _KEY.match(key)
        if match is None:
            raise APIError(400, f"{key}: {_HOW}", param=key)
        index, field = match.groups()
        if index:
            entry = indexed.setdefault(int(index), {})
            if field in entry:
                raise APIError(400, f"{key} is given more than once; send it once", param=key)
        else:
            if not listed or field in listed[-1]:
                listed.append({})
            entry = listed[-1]
        entry[field] = value
    if indexed and listed:
        raise APIError(
            400,
            "controlnet: index every entry (controlnet[0][name]) or none (controlnet[][name]), not both",
            param=PREFIX,
        )
    missing = next((i for i in range(len(indexed)) if i not in indexed), None)
    if missing is not None:
        raise APIError(
            400, f"controlnet[{missing}] is missing: number the entries 0, 1, 2, ...", param=PREFIX
        )
    return [indexed[i] for i in range(len(indexed))] if indexed else listed


def _entry(index: int, fields: dict[str, Any]) -> ControlEntry:
    """One entry's settings (converted from the form's strings) and its image."""
    name = f"{PREFIX}[{index}]"
    image = fields.pop("image", None)
    if image is None or (isinstance(image, str) and not image):
        raise APIError(
            400, f"{name}.image is required: the control image as a file or a data URL", param=f"{name}.image"
        )
    for field, value in fields.items():
        if isinstance(value, UploadFile):
            raise APIError(400, f"{name}.{field}: only {name}.image may be a file", param=f"{name}.{field}")
    try:
        settings = ControlSettings.model_validate(fields, strict=False)
    except ValidationError as exc:
        errors = [{**error, "loc": (name, *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    return settings, image
