"""Images kept on disk for `response_format=url`, served by the server until they expire."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

# Names are random capability tokens: whoever has the URL may fetch it, like a signed URL.
_NAME = re.compile(r"^[A-Za-z0-9_-]{22,64}\.(png|jpeg|webp)$")


class ImageStore:
    def __init__(self, directory: Path, ttl_s: float) -> None:
        self.directory = directory
        self.ttl_s = ttl_s

    def save(self, data: bytes, output_format: str) -> str:
        """Write one image; returns its file name (blocking: call it off the event loop)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{secrets.token_urlsafe(24)}.{output_format}"
        partial = self.directory / f".{name}.part"
        partial.write_bytes(data)
        partial.rename(self.directory / name)
        return name

    def path_for(self, name: str) -> Path | None:
        """The file of a live image, or None if the name is unknown, malformed or expired."""
        if not _NAME.match(name):
            return None
        path = self.directory / name
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        return path if age <= self.ttl_s else None

    def purge_expired(self) -> int:
        if not self.directory.is_dir():
            return 0
        cutoff = time.time() - self.ttl_s
        removed = 0
        for path in self.directory.iterdir():
            if _NAME.match(path.name) and path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
                removed += 1
        return removed
