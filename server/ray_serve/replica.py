"""`EngineReplica`: one Ray Serve replica hosting an `AsyncEngine` (its own batching, its
own device: Ray gives each replica the GPU its `ray_actor_options` asked for)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from engine.engine import AsyncEngine
from engine.forward import ForwardRecord
from engine.request import PartialImage, RequestBatch, RequestOutput
from pipelines.base import Pipeline
from server.app import build_executors
from server.ray_serve.messages import Finished, RemoteCall, ReplicaInfo
from server.settings import ServeSettings

logger = logging.getLogger(__name__)

# Forward records kept for the gateway between two answers (older ones are dropped).
_MAX_UNSENT_FORWARDS = 10_000


class EngineReplica:
    async def __init__(self, settings: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray allows it
        self._settings = ServeSettings(**settings)
        self._engine = AsyncEngine(build_executors(self._settings), self._settings.engine_config())
        self._unsent: list[ForwardRecord] = []
        self._engine.observers.append(self)
        await self._engine.start()
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s serving %s", self._replica_id, self._settings.model)

    def describe(self) -> ReplicaInfo:
        spec = self._engine.spec
        if isinstance(spec, Pipeline):  # in-process: the pipeline itself; send it without weights
            spec = spec.spec()
        assert spec is not None
        return ReplicaInfo(spec, self._engine.batching, self._replica_id)

    async def run(self, call: RemoteCall) -> AsyncIterator[PartialImage | Finished]:
        """The request's previews, then its end. If the caller goes away, Ray cancels this
        generator, and leaving `events()` aborts the request in the engine."""
        try:
            handle = self._engine.submit(call.request)
        except Exception as exc:  # noqa: BLE001 - refused (queue full, bad input): said as the answer
            yield self._finished(error=exc)
            return
        try:
            async for event in handle.events():
                if isinstance(event, PartialImage):
                    yield event
                elif isinstance(event, RequestOutput):
                    yield self._finished(output=event)
        except Exception as exc:  # noqa: BLE001 - the engine's error is the answer
            yield self._finished(error=exc)

    def record_routing_stats(self) -> dict[str, int]:
        """Polled by Serve's controller; request routers see it on each replica."""
        return {"waiting": self._engine.num_waiting, "running": self._engine.num_running}

    async def __del__(self) -> None:
        await self._engine.stop()

    def _finished(self, *, output: RequestOutput | None = None, error: Exception | None = None) -> Finished:
        forwards, self._unsent = tuple(self._unsent), []
        return Finished(self._replica_id, output, error, forwards)

    # EngineObserver: the forwards reach the gateway's /metrics with the next answer.
    def on_forward(self, record: ForwardRecord) -> None:
        if len(self._unsent) < _MAX_UNSENT_FORWARDS:
            self._unsent.append(record)

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        pass
