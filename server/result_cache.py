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

from dataclasses import dataclass

from pipelines.byte_lru import ByteLRU


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
        self._lru: ByteLRU[str, CachedImages] = ByteLRU(capacity_bytes)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    @property
    def evictions(self) -> int:
        return self._lru.evictions

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: str) -> CachedImages | None:
        entry = self._lru.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def put(self, key: str, entry: CachedImages) -> None:
        self._lru.put(key, entry)


def result_cache_for(capacity_mb: float) -> ResultCache | None:
    """The server's result cache, or None when `--result-cache-mb` is 0 (off)."""
    return ResultCache(int(capacity_mb * 2**20)) if capacity_mb > 0 else None
