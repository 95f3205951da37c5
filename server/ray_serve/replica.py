"""`EngineReplica`: one Ray Serve replica hosting an `AsyncEngine` (its own batching, its
own device: Ray gives each replica the GPU its `ray_actor_options` asked for, or with lanes
of several devices the bundles of its placement group, `lane_devices.py`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from engine.core.engine import AsyncEngine
from engine.core.handle import RequestHandle
from engine.core.stats import QuietObserver
from engine.outputs import DecodeRecord, ForwardRecord, ModerationRecord
from engine.request import PartialImage, RequestOutput
from pipelines.base import Pipeline
from server.app import build_executors
from server.ray_serve.lane_devices import hold_lane_devices
from server.ray_serve.messages import Finished, Progress, RemoteCall, ReplicaInfo
from server.settings import ServeSettings
from server.tracing.start import start_tracing

logger = logging.getLogger(__name__)

Event = PartialImage | Progress | RequestOutput | Exception

# Forward records kept for the gateway between two answers (older ones are dropped).
_MAX_UNSENT_FORWARDS = 10_000


class HostedEngine(QuietObserver):
    """One `AsyncEngine` in a replica: its requests' streams, and the forwards and decodes it
    ran that the gateway has not seen yet. A replica holds one (`EngineReplica`), or one per
    loaded model (`MultiplexedReplica`)."""

    def __init__(self, settings: ServeSettings, replica_id: str) -> None:
        self._settings = settings
        self._replica_id = replica_id
        self._engine = AsyncEngine(build_executors(settings), settings.engine_config())
        self._unsent: list[ForwardRecord] = []
        self._unsent_decodes: list[DecodeRecord] = []
        self._unsent_moderations: list[ModerationRecord] = []
        # The events of each request being streamed; video requests get their progress too.
        self._streams: dict[str, asyncio.Queue[Event]] = {}
        self._idle = asyncio.Event()  # set while no request is streamed
        self._idle.set()
        self._engine.observers.append(self)
        # Its requests' engine spans, sent from here under the gateway's span of each (the
        # request's `traceparent` came with it): the replica joins the gateway's trace.
        self._tracing = start_tracing(settings)
        spans = self._tracing.engine_observer(replica_id)
        if spans is not None:
            self._engine.observers.append(spans)

    async def start(self) -> None:
        await self._engine.start()
        logger.info("replica %s serving %s", self._replica_id, self._settings.model)

    async def stop(self) -> None:
        await self._engine.stop()
        await asyncio.to_thread(self._tracing.shutdown)

    async def drained(self) -> None:
        """Returns once no request is being streamed (none queued or running)."""
        await self._idle.wait()

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    def describe(self) -> ReplicaInfo:
        spec = self._engine.spec
        if isinstance(spec, Pipeline):  # in-process: the pipeline itself; send it without weights
            spec = spec.spec()
        assert spec is not None
        return ReplicaInfo(spec, self._engine.batching, self._replica_id)

    async def run(self, call: RemoteCall) -> AsyncIterator[PartialImage | Progress | Finished]:
        """The request's previews (and a video's progress), then its end. If the caller goes
        away, Ray cancels this generator, and leaving `events()` aborts the request."""
        try:
            handle = self._engine.submit(call.on_this_clock())
        except Exception as exc:  # noqa: BLE001 - refused (queue full, bad input): said as the answer
            yield self._finished(error=exc)
            return
        events: asyncio.Queue[Event] = asyncio.Queue()
        self._streams[handle.request_id] = events
        self._idle.clear()
        pump = asyncio.create_task(_pump(handle, events))
        try:
            while True:
                event = await events.get()
                if isinstance(event, RequestOutput):
                    yield self._finished(output=event)
                    return
                if isinstance(event, Exception):
                    yield self._finished(error=event)
                    return
                yield event
        finally:
            self._streams.pop(handle.request_id, None)
            if not self._streams:
                self._idle.set()
            pump.cancel()  # an unfinished request is aborted as its events() closes

    def _finished(self, *, output: RequestOutput | None = None, error: Exception | None = None) -> Finished:
        forwards, self._unsent = tuple(self._unsent), []
        decodes, self._unsent_decodes = tuple(self._unsent_decodes), []
        moderations, self._unsent_moderations = tuple(self._unsent_moderations), []
        return Finished(self._replica_id, output, error, forwards, decodes, moderations)

    # EngineObserver: the forwards and decodes reach the gateway's /metrics with the next answer.
    def on_forward(self, record: ForwardRecord) -> None:
        if len(self._unsent) < _MAX_UNSENT_FORWARDS:
            self._unsent.append(record)

    def on_decode(self, record: DecodeRecord) -> None:
        if len(self._unsent_decodes) < _MAX_UNSENT_FORWARDS:
            self._unsent_decodes.append(record)

    def on_moderation(self, record: ModerationRecord) -> None:
        if len(self._unsent_moderations) < _MAX_UNSENT_FORWARDS:
            self._unsent_moderations.append(record)

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        if self._engine.modality != "video":  # only video jobs report progress
            return
        for request_id in request_ids:
            events = self._streams.get(request_id)
            if events is not None:
                events.put_nowait(Progress(done, total))


class EngineReplica:
    async def __init__(self, settings: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray allows it
        replica_id = serve.get_replica_context().replica_id.unique_id
        # Lanes of several devices: their bundles held (and GPUs named) before the workers spawn.
        self._bundle_holders = await hold_lane_devices()
        self._hosted = HostedEngine(ServeSettings(**settings), replica_id)
        await self._hosted.start()

    def describe(self) -> ReplicaInfo:
        return self._hosted.describe()

    async def run(self, call: RemoteCall) -> AsyncIterator[PartialImage | Progress | Finished]:
        async for event in self._hosted.run(call):
            yield event

    def record_routing_stats(self) -> dict[str, int]:
        """Polled by Serve's controller, which hands it to the request routers: the gateway's
        waiting gauge sums `waiting` over the replicas (server/ray_serve/watch.py)."""
        engine = self._hosted.engine
        return {"waiting": engine.num_waiting, "running": engine.num_running}

    async def __del__(self) -> None:
        await self._hosted.stop()


async def _pump(handle: RequestHandle, events: asyncio.Queue[Event]) -> None:
    """The request's previews and output (or error) into `events`."""
    try:
        async for event in handle.events():
            if event is not None:
                events.put_nowait(event)
    except Exception as exc:  # noqa: BLE001 - the engine's error is the answer
        events.put_nowait(exc)
