"""`/playground/`: a page that tries the server in a browser, served from `server/playground/`
(HTML, CSS and ES modules shipped as package data; no build step). It is static: it needs
no key itself and talks only to this server's public API, sending the key the user enters."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

ASSETS = Path(__file__).resolve().parents[1] / "playground"

# Nothing but this server: the page must work offline, and a script could not send a
# prompt or a key anywhere else even if one got in. data: and blob: are the images it shows
# (base64 results, uploads) and the videos it downloads.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; object-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class PlaygroundFiles(StaticFiles):
    """Starlette's static files with the page's security headers. `no-cache` makes the
    browser revalidate (a cheap 304), so an upgraded server never runs yesterday's script."""

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-cache"
        return response


router = APIRouter()
# `/playground` redirects to `/playground/`, so the page's relative links resolve inside it.
router.mount("/playground", PlaygroundFiles(directory=ASSETS, html=True), name="playground")
