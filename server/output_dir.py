"""One server per `--output-dir`: two would mark each other's running video jobs failed at
start-up, purge each other's files and race on the job table."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class OutputDirLockedError(RuntimeError):
    pass


class OutputDirLock:
    """Held while the server runs; the operating system releases it if the process dies."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()  # closing the file releases the lock


def lock_output_dir(directory: Path) -> OutputDirLock:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".diffbatch.lock"
    file = path.open("a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        raise OutputDirLockedError(
            f"another diffbatch server (pid {holder}) uses --output-dir {directory}; "
            "give each server a directory of its own"
        ) from None
    file.seek(0)
    file.truncate()
    file.write(str(os.getpid()))
    file.flush()
    return OutputDirLock(file)
