"""The conditioning entries of a multipart form (`POST /v1/images/edits`), nested as Rack and
PHP nest form fields: `controlnet[0][name]`, `controlnet[0][image]` (a file part, or a data URL
or bare base64 as text), and optionally `controlnet[0][scale]`, `[start]` and `[end]`; likewise
`ip_adapter[0][name]`, `ip_adapter[0][image]` and optionally `ip_adapter[0][scale]`.

The index may be left empty, `controlnet[][name]`: that is how the official `openai` client
sends `extra_body={"controlnet": [{...}, {...}]}` in a form (brackets, entry after entry). An
entry then ends where one of its fields comes again (Rack's rule), which keeps each entry's
fields together as long as they are sent in order, as the client does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData, UploadFile

from engine.request import MAX_CONTROLNETS, MAX_IP_ADAPTERS
from server.errors import APIError
from server.protocol import ControlSettings, IPAdapterSettings

_Settings = TypeVar("_Settings", bound=BaseModel)


@dataclass(frozen=True)
class NestedField(Generic[_Settings]):
    """A list field of image entries as a form nests it: `prefix[i][field]`, each entry's
    settings read by `schema` and its `image` a file part or text."""

    prefix: str
    schema: type[_Settings]
    most: int
    # What to send, said in every error about the entry's keys.
    how: str
    # What the entry's image is, for the error of an entry without one.
    image_is: str

    def key(self) -> re.Pattern[str]:
        # prefix[<index or nothing>][<field>]; a few digits bound the index before it is read.
        return re.compile(rf"^{re.escape(self.prefix)}\[(\d{{0,3}})\]\[([a-z_]{{1,16}})\]$")


CONTROLNET: NestedField[ControlSettings] = NestedField(
    "controlnet",
    ControlSettings,
    MAX_CONTROLNETS,
    "send each ControlNet as form fields controlnet[0][name] and controlnet[0][image] (a file or "
    "a data URL), optionally controlnet[0][scale], controlnet[0][start] and controlnet[0][end]",
    "the control image",
)
IP_ADAPTER: NestedField[IPAdapterSettings] = NestedField(
    "ip_adapter",
    IPAdapterSettings,
    MAX_IP_ADAPTERS,
    "send each IP-Adapter as form fields ip_adapter[0][name] and ip_adapter[0][image] (a file or "
    "a data URL), optionally ip_adapter[0][scale]",
    "the reference image",
)


@dataclass(frozen=True)
class FormEntries(Generic[_Settings]):
    """A form's entries of one nested field, each its settings and its image, and the form
    keys they came in (not the body's fields)."""

    entries: list[tuple[_Settings, str | UploadFile]]
    keys: tuple[str, ...]


def form_entries(form: FormData, nested: NestedField[_Settings]) -> FormEntries[_Settings]:
    """The form's entries of `nested` in order, checked: 400 naming the part that is wrong."""
    parts = [(key, value) for key, value in form.multi_items() if key.startswith(nested.prefix)]
    grouped = _grouped(parts, nested)
    if len(grouped) > nested.most:
        raise APIError(400, f"at most {nested.most} {nested.prefix} entries per request", param=nested.prefix)
    entries = [_entry(index, fields, nested) for index, fields in enumerate(grouped)]
    return FormEntries(entries, tuple(dict.fromkeys(key for key, _ in parts)))


def form_controls(form: FormData) -> FormEntries[ControlSettings]:
    return form_entries(form, CONTROLNET)


def form_ip_adapters(form: FormData) -> FormEntries[IPAdapterSettings]:
    return form_entries(form, IP_ADAPTER)


def _grouped(parts: list[tuple[str, Any]], nested: NestedField[Any]) -> list[dict[str, Any]]:
    """Each entry's fields, by explicit index or, with empty brackets, in the order sent."""
    pattern, prefix = nested.key(), nested.prefix
    indexed: dict[int, dict[str, Any]] = {}
    listed: list[dict[str, Any]] = []
    for key, value in parts:
        match = pattern.match(key)
        if match is None:
            raise APIError(400, f"{key}: {nested.how}", param=key)
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
            f"{prefix}: index every entry ({prefix}[0][name]) or none ({prefix}[][name]), not both",
            param=prefix,
        )
    missing = next((i for i in range(len(indexed)) if i not in indexed), None)
    if missing is not None:
        raise APIError(400, f"{prefix}[{missing}] is missing: number the entries 0, 1, 2, ...", param=prefix)
    return [indexed[i] for i in range(len(indexed))] if indexed else listed


def _entry(
    index: int, fields: dict[str, Any], nested: NestedField[_Settings]
) -> tuple[_Settings, str | UploadFile]:
    """One entry's settings (converted from the form's strings) and its image."""
    name = f"{nested.prefix}[{index}]"
    image = fields.pop("image", None)
    if image is None or (isinstance(image, str) and not image):
        raise APIError(
            400,
            f"{name}.image is required: {nested.image_is} as a file or a data URL",
            param=f"{name}.image",
        )
    for field, value in fields.items():
        if isinstance(value, UploadFile):
            raise APIError(400, f"{name}.{field}: only {name}.image may be a file", param=f"{name}.{field}")
    try:
        settings = nested.schema.model_validate(fields, strict=False)
    except ValidationError as exc:
        errors = [{**error, "loc": (name, *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    return settings, image
