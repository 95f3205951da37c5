"""`LocalOutputStore`: output files in a directory (`--output-dir`), the default."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from starlette.responses import FileResponse, Response

from server.outputs.store import StoredFile

# A file is written here first and renamed into place, so a reader never sees half a file;
# a .part left by a crash is purged by the files' owners once it is old.
PARTIAL_SUFFIX = ".part"


def _sync_directory(directory: Path) -> None:
    """Make a rename in `directory` survive a power loss (POSIX keeps it in the directory's
    own blocks). A file system that cannot sync a directory says so with EINVAL: skipped."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(descriptor)


class LocalOutputStore:
    shared = False  # several servers may share a directory, but only with a shared job table
    opens_late = True

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / key

    def write(self, key: str, data: bytes, media_type: str) -> None:
        """The file in place and on disk before this returns: a video job is recorded
        completed, and an image's URL answered, only after its files are written, so a power
        loss after that must not take them (a few ms of fsync per file)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        with partial.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        partial.rename(path)
        _sync_directory(path.parent)

    def read(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)

    def listing(self, prefix: str) -> Iterator[StoredFile]:
        folder, _, start = prefix.rpartition("/")
        directory = self.root / folder
        if not directory.is_dir():
            return
        for path in directory.iterdir():
            if not path.name.startswith(start) or not path.is_file():
                continue
            try:
                modified = path.stat().st_mtime
            except FileNotFoundError:  # removed meanwhile
                continue
            yield StoredFile(f"{folder}/{path.name}" if folder else path.name, modified)

    def modified(self, key: str) -> float | None:
        try:
            return self.path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def link(self, key: str, media_type: str, filename: str | None = None) -> str | None:
        return None  # only this server can read its directory

    def response(self, key: str, media_type: str, filename: str | None = None) -> Response | None:
        path = self.path(key)
        if not path.is_file():
            return None
        # Opened when the response is sent: a DELETE meanwhile is held off by the caller
        # (VideoService's recent downloads); an open file survives an unlink.
        return FileResponse(path, media_type=media_type, filename=filename)
