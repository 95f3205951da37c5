"""The result cache (`--result-cache-mb`): an exact repeat of an image request is answered
from an LRU of the images it got, encoded, without reaching the engine.

It sits at the route, keyed by what makes the images (`result_cache_key`: the parsed body
— model, LoRA adapter, prompt, every parameter that changes a pixel, the output format —
and any uploaded images and mask, as pixels), and holds encoded images, so a hit costs a
lookup and building the JSON. Only requests that set a seed are cached or answered from it:
without one every request draws new noise and must get a new image. Streamed requests are
neither (their previews cannot be replayed), and each entry holds all `n` images of its
request.

Entries are per tenant (API key) by default (`--result-cache-scope tenant`): a hit is
answered in milliseconds, so a shared entry would tell one key that another already ran
that exact prompt and seed (and what it got).

The routes hold a `ResultCacheService`: this process's `ResultCache`, or with several API
processes the engine process's, reached over its socket
(`server.api_servers.result_cache_client`): one LRU and one hit count for every process.
Its `get` and `put` are awaited for that reason; here they return at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipelines.byte_lru import ByteLRU
from server.idempotency import fingerprint
from server.protocol import ImageGenerationRequest

# Fields that change neither the images nor their encoding, left out of the key so that
# requests differing only there share an entry. `response_format` is one: the cache holds
# encoded images, and b64_json or url is chosen when answering from them. `quality` is keyed
# by the tier it picks (`hd` and `high` make the same images); `stream` and `partial_images`
# matter only to streams, which are never cached; a transparent `background` is refused
# before the cache is asked. `moderation` is keyed: with a safety checker, an image that
# passed the lenient threshold must not answer a request that asked for the default one.
NOT_IN_IMAGES = frozenset(
    {
        "timeout",
        "priority",
        "user",
        "safety_identifier",
        "response_format",
        "quality",
        "stream",
        "partial_images",
        "style",
        "complexity",
        "background",
        "input_fidelity",
    }
)


@dataclass(frozen=True, slots=True)
class CachedImages:
    """One request's answer before it became JSON: its encoded images, seeds and size."""

    images: tuple[bytes, ...]
    seeds: tuple[int, ...]
    size: str

    @property
    def nbytes(self) -> int:
        return sum(len(image) for image in self.images)


class ResultCacheService(Protocol):
    async def get(self, key: str) -> CachedImages | None:
        """The entry of `key`, counted as a hit, or None, counted as a miss."""
        ...

    async def put(self, key: str, entry: CachedImages) -> None:
        """Keep `entry` (returns once a repeat sent anywhere would find it)."""
        ...


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

    async def get(self, key: str) -> CachedImages | None:
        entry = self._lru.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    async def put(self, key: str, entry: CachedImages) -> None:
        self._lru.put(key, entry)


def result_cache_key(
    body: ImageGenerationRequest, kind: str, uploads: str, tenant: str | None = None
) -> str | None:
    """The key of a `kind` request (image_generation, image_edit) with `body` and uploads
    digested as `uploads` (`server.uploads.pixels_digest`), in `tenant`'s part of the cache
    (None: the part every caller shares); None where it may not be answered from the cache:
    it sets no seed (every request must draw new noise) or it is streamed (previews cannot be
    replayed). Everything that makes the images: the body less `NOT_IN_IMAGES`, the quality
    tier, the uploads."""
    if body.seed is None or body.stream:
        return None
    fields = body.model_dump_json(exclude=set(NOT_IN_IMAGES))
    scope = "" if tenant is None else f"{tenant}:"
    return f"{kind}:{scope}{fingerprint(fields, str(body.quality_tier()), uploads)}"


def result_cache_for(capacity_mb: float) -> ResultCache | None:
    """The server's result cache, or None when `--result-cache-mb` is 0 (off)."""
    return ResultCache(int(capacity_mb * 2**20)) if capacity_mb > 0 else None
