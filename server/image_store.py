"""Images kept for `response_format=url` on the output store, served until they expire."""

from __future__ import annotations

import re
import secrets
import time

from starlette.responses import Response

from server.media import MEDIA_TYPE
from server.outputs.local import PARTIAL_SUFFIX
from server.outputs.store import OutputStore

# Names are random capability tokens: whoever has the URL may fetch it, like a signed URL.
_NAME = re.compile(r"^[A-Za-z0-9_-]{22,64}\.(png|jpeg|webp)$")
FOLDER = "images"


class ImageStore:
    """Every call blocks (disk or network): call it off the event loop."""

    def __init__(self, outputs: OutputStore, ttl_s: float) -> None:
        self.outputs = outputs
        self.ttl_s = ttl_s

    def save(self, data: bytes, output_format: str) -> str:
        """Write one image; returns its name."""
        name = f"{secrets.token_urlsafe(24)}.{output_format}"
        self.outputs.write(f"{FOLDER}/{name}", data, MEDIA_TYPE[output_format])
        return name

    def link(self, name: str) -> str | None:
        """A URL the client fetches the image from directly (a presigned one from a bucket),
        or None: the server's own /generated/NAME serves it."""
        return self.outputs.link(f"{FOLDER}/{name}", _media_type(name))

    def response(self, name: str) -> Response | None:
        """A live image as a response, or None if the name is unknown, malformed or expired."""
        if not _NAME.match(name):
            return None
        key = f"{FOLDER}/{name}"
        modified = self.outputs.modified(key)
        if modified is None or time.time() - modified > self.ttl_s:
            return None
        return self.outputs.response(key, _media_type(name))

    def purge_expired(self) -> int:
        cutoff = time.time() - self.ttl_s
        expired = [
            stored.key
            for stored in self.outputs.listing(f"{FOLDER}/")
            if stored.modified < cutoff
            and (_NAME.match(stored.key.rpartition("/")[2]) or stored.key.endswith(PARTIAL_SUFFIX))
        ]
        self.outputs.delete(expired)
        return len(expired)


def _media_type(name: str) -> str:
    return MEDIA_TYPE[name.rpartition(".")[2]]
