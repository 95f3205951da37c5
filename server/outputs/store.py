"""The one interface output files are written, served and expired through (`OutputStore`).

Keys are relative paths (`videos/video_….mp4`, `images/….png`): a directory under
`--output-dir` locally, or objects under the prefix of `--output-url` in a bucket. Every
call blocks (disk or network): call it off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from starlette.responses import Response


class OutputStoreError(RuntimeError):
    """The store cannot be used; the message is one line naming the setting to change."""


class OutputStoreUnavailableError(OutputStoreError):
    """The store cannot be used now (its bucket is gone, its endpoint unreachable): a 503
    naming the store; the reason is the operator's, said once in the log."""


@dataclass(frozen=True, slots=True)
class StoredFile:
    key: str
    modified: float  # seconds since the epoch, from the store's own clock


class OutputStore(Protocol):
    # Whether other servers read and write the same files (a bucket), so none of them may
    # treat a file it did not write as its own leftover.
    shared: bool
    # Whether a response opens its file only when it is sent (a local file), so a DELETE
    # just after must leave the file a moment; a bucket's response has its object already.
    opens_late: bool

    def write(self, key: str, data: bytes, media_type: str) -> None:
        """Write the whole file at once: a reader sees it complete or not at all."""
        ...

    def read(self, key: str) -> bytes:
        """The file's bytes; `FileNotFoundError` if there is none."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Remove the files (missing ones are no error)."""
        ...

    def listing(self, prefix: str) -> Iterator[StoredFile]:
        """The files whose key starts with `prefix` (partial writes included where a store
        has them, so leftovers of a crash can be purged)."""
        ...

    def modified(self, key: str) -> float | None:
        """When the file was written; None if there is none."""
        ...

    def link(self, key: str, media_type: str, filename: str | None = None) -> str | None:
        """A URL clients may fetch the file from directly (a presigned URL), or None when the
        server must serve it itself (`response`)."""
        ...

    def response(self, key: str, media_type: str, filename: str | None = None) -> Response | None:
        """The file as an HTTP response: served from disk, streamed from the bucket
        (`--proxy-content`), or a redirect to a presigned URL; None if there is no file."""
        ...
