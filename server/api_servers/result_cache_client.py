"""`ResultCacheClient`: the result cache (`--result-cache-mb`) as an API process of several
holds it — the engine process's one `ResultCache` (`server.result_cache`), so that a repeat
sent through any API process finds what another answered, and its hits and misses are
counted once. A lookup is one round trip (`CacheGet`), the images coming back beside the
message; a store (`CachePut`) is answered once kept, before the first request's own answer
leaves, so its repeat cannot arrive first.
"""

from __future__ import annotations

import contextlib

from engine.errors import EngineNotRunningError, EngineRestartingError
from server.api_servers.client import EngineClient
from server.api_servers.messages import CacheGet, CachePut
from server.result_cache import CachedImages

# The engine process away (restarting, stopping, not answering): the cache with it.
_AWAY = (EngineNotRunningError, EngineRestartingError, TimeoutError)


class ResultCacheClient:
    """`ResultCacheService` over the engine process's socket (`EngineClient.call`)."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    async def get(self, key: str) -> CachedImages | None:
        try:
            entry: CachedImages | None = await self._client.call(lambda call_id: CacheGet(call_id, key))
        except _AWAY:
            return None  # a miss: the request then runs, and hears why it cannot
        return entry

    async def put(self, key: str, entry: CachedImages) -> None:
        with contextlib.suppress(*_AWAY):  # the cache went with the engine process: the answer stands
            await self._client.call(lambda call_id: CachePut(call_id, key, entry))
