"""The result cache (`--result-cache-mb`): an exact repeat of an image request is answered
from an LRU of the images it got, encoded, without reaching the engine.

It sits at the route, keyed by the request's digest (`server.idempotency.fingerprint`: the
parsed body — model, LoRA adapter, prompt, every parameter, the output format — and any
uploaded images and mask), and holds encoded images, so a hit costs a lookup and building
the JSON. Only requests that set a seed are cached or answered from it: without one every
request draws new noise and must get a new image. Streamed requests are neither (their
previews cannot be replayed), and each entry holds all `n` images of its request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CachedImages:
    """One request's answer before it became JSON: its encoded images, seeds and size."""

    images: tuple[bytes, ...]
    seeds: tuple[int, ...]
    size: str

    @property
    def nbytes(self) -> int:
        return sum(len(image) for image in self.images)


class ResultCache:
    """An LRU of `CachedImages` by request digest, bounded in bytes; used on the event loop only."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.nbytes = 0
        self._entries: OrderedDict[str, CachedImages] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedImages | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, entry: CachedImages) -> None:
        if entry.nbytes > self.capacity_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1


def result_cache_for(capacity_mb: float) -> ResultCache | None:
    """The server's result cache, or None when `--result-cache-mb` is 0 (off)."""
    return ResultCache(int(capacity_mb * 2**20)) if capacity_mb > 0 else None
