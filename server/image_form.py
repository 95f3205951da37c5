"""The multipart form of the image endpoints that take uploads (edits, variations): its content
type checked, and its text fields parsed into the endpoint's schema, converted from the
strings a form holds. The uploads themselves are read by `server.uploads`."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData

from server.errors import APIError
from server.state import form_fields

_Body = TypeVar("_Body", bound=BaseModel)


def require_multipart(request: Request, message: str) -> None:
    """400 with `message` (what to send, and how) unless the body is a multipart form."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, message)


def form_body(form: FormData, schema: type[_Body], file_fields: tuple[str, ...]) -> _Body:
    """The form's fields other than `file_fields`, each given once, as `schema`: a file in any
    other field, or a field `schema` refuses, is a 400 naming it."""
    fields = form_fields(form, file_fields)
    if any(not isinstance(value, str) for value in fields.values()):
        files = " and ".join(dict.fromkeys(field.removesuffix("[]") for field in file_fields))
        raise APIError(
            400,
            f"only {files} may be files",
            param=next(k for k, v in fields.items() if not isinstance(v, str)),
        )
    try:
        return schema.model_validate(fields, strict=False)  # a form's strings, converted
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
