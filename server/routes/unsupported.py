"""OpenAI endpoints this server does not implement, answered by name (404, code
`unsupported_endpoint`) rather than with a bare "Not Found", so a client learns what to do
instead. The README's compatibility table lists them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends

from server.errors import ERROR_RESPONSES, APIError
from server.state import require_api_key

router = APIRouter(
    dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES, include_in_schema=False
)

UNSUPPORTED: dict[tuple[str, str], str] = {
    ("POST", "/v1/videos/edits"): "video edits are not supported: create a new video, or remix a "
    "completed one with POST /v1/videos/{video_id}/remix",
    ("POST", "/v1/videos/extensions"): "video extensions are not supported: create a longer video "
    "(seconds), or remix a completed one",
    ("POST", "/v1/videos/characters"): "video characters are not supported",
    ("GET", "/v1/videos/characters/{character_id}"): "video characters are not supported",
}


def _refuse(message: str) -> Callable[[], Awaitable[None]]:
    async def refuse() -> None:
        raise APIError(404, message, type="invalid_request_error", code="unsupported_endpoint")

    return refuse


for (method, path), message in UNSUPPORTED.items():
    router.add_api_route(path, _refuse(message), methods=[method])
