"""`MultiplexedReplica`: one engine deployment for several models, with Serve's model
multiplexing (`--ray-models-per-replica K`): each replica holds up to K of them at once,
each its own `AsyncEngine` (its own batching), loaded when a request for it arrives.

The gateway sends each model's requests with `multiplexed_model_id=NAME`; Serve's router
prefers a replica that has NAME loaded, else one holding the fewest models, which loads it,
unloading its least recently used model when it already holds K. Serve unloads without
asking whether that model is busy: its engine first finishes the requests it has (new
requests for it wait for its reload), then stops.

The router: our `BatchKeyRouter` does not look at the model id (only Serve's
`MultiplexMixin` does, as its default router mixes it in), so this deployment always uses
the default router; keeping a model's requests on the replica that has it loaded matters
more here than spreading batch keys.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from engine.request import PartialImage
from server.ray_serve.messages import Finished, Progress, RemoteCall, ReplicaInfo
from server.ray_serve.replica import HostedEngine
from server.settings import ModelEntry, ServeSettings

logger = logging.getLogger(__name__)


class MultiplexedReplica:
    def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = ServeSettings(**settings)
        self._entries: dict[str, ModelEntry] = {entry.name: entry for entry in self._settings.models}
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._loaded: dict[str, HostedEngine] = {}
        limit = self._settings.ray_models_per_replica or len(self._entries)

        # A function made per instance (K is a setting; Serve finds a loader stored so), not
        # the bound method: Serve keeps its model cache as an attribute of what it wraps.
        async def load(name: str) -> _Loaded:
            return await self._load(name)

        self._engine_for = serve.multiplexed(max_num_models_per_replica=limit)(load)

    async def _load(self, name: str) -> _Loaded:
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"this deployment serves no model {name!r}")
        hosted = HostedEngine(self._settings.for_entry(entry), self._replica_id)
        await hosted.start()
        self._loaded[name] = hosted
        return _Loaded(name, hosted, self._loaded)

    async def _hosted(self) -> HostedEngine:
        loaded: _Loaded = await self._engine_for(serve.get_multiplexed_model_id())
        return loaded.hosted

    async def describe(self) -> ReplicaInfo:
        return (await self._hosted()).describe()

    async def run(self, call: RemoteCall) -> AsyncIterator[PartialImage | Progress | Finished]:
        hosted = await self._hosted()
        async for event in hosted.run(call):
            yield event

    def record_routing_stats(self) -> dict[str, int]:
        """Every loaded model's engine counted together (see `EngineReplica`)."""
        engines = [hosted.engine for hosted in self._loaded.values()]
        return {
            "waiting": sum(engine.num_waiting for engine in engines),
            "running": sum(engine.num_running for engine in engines),
        }

    async def __del__(self) -> None:
        for hosted in list(self._loaded.values()):
            await hosted.stop()


class _Loaded:
    """What Serve's multiplexing caches per model: it awaits `__del__` to unload one. Set on
    the instance, not the class: the garbage collector calls a class's `__del__` too, and
    would leave that coroutine never awaited."""

    def __init__(self, name: str, hosted: HostedEngine, loaded: dict[str, HostedEngine]) -> None:
        self.name = name
        self.hosted = hosted
        self._loaded = loaded
        self.__del__ = self._unload

    async def _unload(self) -> None:
        logger.info("unloading model %s: finishing its requests first", self.name)
        await self.hosted.drained()
        await self.hosted.stop()
        self._loaded.pop(self.name, None)
