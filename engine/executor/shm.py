"""Large arrays between processes through `multiprocessing.shared_memory`, by handle.

A worker process's result is sent through a pipe, but every numpy array of at least
`SHM_MIN_BYTES` in it — images, video frames, audio, latents, nested anywhere in tuples,
lists, dicts or dataclasses — is first copied into a shared-memory segment of its own and
replaced by a small `SharedArray` handle. The receiver copies each array out, then closes
and unlinks its segment, so no segment outlives the message that named it. The sender
keeps no mapping (it closes its side at once) and remembers nothing.

Segments are named `<prefix><counter>`, every prefix beginning with the creating process
(`diffbatch-<pid>-`): a worker's results under `worker_prefix(<its pid>)`, the input images
one executor sends its current worker under `inputs_prefix(<executor>, <worker>)`, so that
the lanes of one server never take a name twice and a sweep (`sweep`: what a worker that
died left, created or never read) touches only its own lane's segments. No prefix is a
prefix of another's names (each ends in "-").

Pure of torch and of the event loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterable
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
        """`value` with its large arrays shared; if one cannot be (/dev/shm is full, say),
        the segments already made for it are unlinked, then it raises."""
        created: list[str] = []
        try:
            return self._pack(value, created)
        except BaseException:
            unlink(created)
            raise

    def _pack(self, value: Any, created: list[str]) -> Any:
        if isinstance(value, np.ndarray):
            if value.nbytes < self.min_bytes:
                return value
            shared = self._share(value)
            created.append(shared.name)
            return shared
        return _rebuild(value, lambda item: self._pack(item, created))

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
    side; call it exactly once per message, also for a result nobody wants any more). If
    one cannot be read, every segment the message names is still unlinked, then it raises."""
    try:
        return _rebuild(value, _copy_out)
    except BaseException:
        discard(value)
        raise


def _copy_out(value: Any) -> Any:
    if isinstance(value, SharedArray):
        segment = shared_memory.SharedMemory(name=value.name)
        try:
            array = np.ndarray(value.shape, np.dtype(value.dtype), buffer=segment.buf).copy()
        finally:
            segment.close()
            segment.unlink()
        return array
    return _rebuild(value, _copy_out)


def discard(value: Any) -> int:
    """Unlink every segment a packed message names, without reading it (a message that will
    not be delivered); those already gone are skipped. How many were unlinked."""
    return unlink(shared_names(value))


def unlink(names: Iterable[str]) -> int:
    """Unlink the segments `names`; those already gone are skipped. How many were unlinked."""
    return sum(_unlink(name) for name in names)


def shared_names(value: Any) -> list[str]:
    """The segments a packed message names, in order."""
    if isinstance(value, SharedArray):
        return [value.name]
    found: list[str] = []

    def collect(item: Any) -> Any:
        found.extend(shared_names(item))
        return item

    _rebuild(value, collect)
    return found


def count_shared(value: Any) -> int:
    """How many shared arrays a message names (the transport is observable)."""
    return len(shared_names(value))


def segments(prefix: str) -> list[str]:
    """Names of the shared-memory segments that start with `prefix` (Linux: /dev/shm)."""
    if not _SHM_DIR.is_dir():
        return []
    return sorted(path.name for path in _SHM_DIR.iterdir() if path.name.startswith(prefix))


def sweep(prefix: str) -> int:
    """Unlink the segments a dead worker left behind; how many there were."""
    return unlink(segments(prefix))


def _unlink(name: str) -> bool:
    """Unlink one segment; False if it is already gone (another sweep may race this one)."""
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:
        _untrack(segment)  # opening it registered it with the resource tracker
        return False
    return True


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
    """The prefix of every segment process `pid` (default: this one) creates; a worker's
    results are named under it."""
    return f"diffbatch-{os.getpid() if pid is None else pid}-"


def inputs_prefix(executor: int, worker: int) -> str:
    """The prefix of the input images this process sends to the `worker`-th worker process
    (one per restart) of its `executor`-th executor (one per lane)."""
    return f"{worker_prefix()}in-{executor}-{worker}-"


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
