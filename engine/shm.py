"""Large arrays between processes through `multiprocessing.shared_memory`, by handle.

A worker process's result is sent through a pipe, but every numpy array of at least
`SHM_MIN_BYTES` in it — images, video frames, audio, latents, nested anywhere in tuples,
lists, dicts or dataclasses — is first copied into a shared-memory segment of its own and
replaced by a small `SharedArray` handle. The receiver copies each array out, then closes
and unlinks its segment, so no segment outlives the message that named it. The sender
keeps no mapping (it closes its side at once) and remembers nothing.

Segments are named `<prefix><counter>`, the prefix naming the worker (`diffbatch-<pid>-`),
so that a receiver can sweep the segments of a worker that died between creating one
and sending its handle (`sweep`).

Pure of torch and of the event loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

# Below this an array travels inside the pickled message: a segment costs two system calls
# and a file descriptor, more than copying a few KiB through the pipe.
SHM_MIN_BYTES = 64 * 1024
_SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class SharedArray:
    """A numpy array waiting in the shared-memory segment `name`."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class Packer:
    """Replaces large arrays by `SharedArray` handles, in the sending process."""

    def __init__(self, prefix: str, min_bytes: int = SHM_MIN_BYTES) -> None:
        self.prefix = prefix
        self.min_bytes = min_bytes
        self._counter = itertools.count()
        self.segments_created = 0

    def pack(self, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return self._share(value) if value.nbytes >= self.min_bytes else value
        return _rebuild(value, self.pack)

    def _share(self, array: np.ndarray) -> SharedArray:
        array = np.ascontiguousarray(array)
        name = f"{self.prefix}{next(self._counter)}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=max(1, array.nbytes))
        try:
            np.ndarray(array.shape, array.dtype, buffer=segment.buf)[...] = array
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        segment.close()
        _untrack(segment)  # the receiver unlinks it; the sender's tracker must not
        self.segments_created += 1
        return SharedArray(name, tuple(array.shape), array.dtype.str)


def unpack(value: Any) -> Any:
    """Copy every shared array out of its segment and unlink the segment (the receiver's
    side; call it exactly once per message, also for a result nobody wants any more)."""
    if isinstance(value, SharedArray):
        segment = shared_memory.SharedMemory(name=value.name)
        try:
            array = np.ndarray(value.shape, np.dtype(value.dtype), buffer=segment.buf).copy()
        finally:
            segment.close()
            segment.unlink()
        return array
    return _rebuild(value, unpack)


def count_shared(value: Any) -> int:
    """How many shared arrays a message names (the transport is observable)."""
    if isinstance(value, SharedArray):
        return 1
    found = 0

    def count(item: Any) -> Any:
        nonlocal found
        found += count_shared(item)
        return item

    _rebuild(value, count)
    return found


def segments(prefix: str) -> list[str]:
    """Names of the shared-memory segments that start with `prefix` (Linux: /dev/shm)."""
    if not _SHM_DIR.is_dir():
        return []
    return sorted(path.name for path in _SHM_DIR.iterdir() if path.name.startswith(prefix))


def sweep(prefix: str) -> int:
    """Unlink the segments a dead worker left behind; how many there were."""
    removed = 0
    for name in segments(prefix):
        try:
            segment = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        segment.close()
        segment.unlink()
        removed += 1
    return removed


def sweep_orphans() -> int:
    """Unlink the segments of diffbatch processes that no longer exist (killed outside any
    server that could sweep after them, e.g. the whole server SIGKILLed); how many there
    were. A process still alive (or whose pid was reused) keeps its segments."""
    removed = 0
    owners = {_owner(name) for name in segments("diffbatch-")}
    for pid in sorted(pid for pid in owners if pid is not None):
        if not _alive(pid):
            removed += sweep(worker_prefix(pid))
    return removed


def _owner(name: str) -> int | None:
    owner = name.removeprefix("diffbatch-").split("-", 1)[0]
    return int(owner) if owner.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def worker_prefix(pid: int | None = None) -> str:
    return f"diffbatch-{os.getpid() if pid is None else pid}-"


def _rebuild(value: Any, convert: Any) -> Any:
    """`value` with `convert` applied to each element of its containers."""
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(convert(v) for v in value)
    if isinstance(value, list):
        return [convert(v) for v in value]
    if isinstance(value, dict):
        return {k: convert(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Python registers every created segment with the creating process's resource tracker,
    which unlinks it (and warns) when that process exits: a result already handed to the
    receiver would vanish, or be unlinked twice. Ownership passes to the receiver."""
    from multiprocessing import resource_tracker

    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
