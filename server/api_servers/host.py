"""`EngineHost`: the engine process's side of the API processes' connections. It serves
one `EngineService` (an `AsyncEngine`, or a `ModelSet`) to every connection: admits what
they submit, streams each request's events back on the connection that sent it, answers
their calls (a model's claim, the metrics text, the API keys' limits and the result cache,
which it keeps once for every process), and sends each a `Snapshot` of the engine
every `SNAPSHOT_PERIOD_S` — and at once, to every connection, whenever what `/health` says
has changed by the time an answer is sent: a client that gets a request's 503
`worker_restarting` (or a claim's failed load) and then asks `/health`, of either process,
reads the state that answer came from, as in one process.

A connection that closes (its API process died, or stopped) aborts every request it sent
and drops its claims and its keys' counts: nothing runs for a caller who is gone, as with a
client that disconnects from one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from engine.core.handle import RequestHandle
from engine.core.lanes import WorkerHealth
from engine.core.service import EngineService, ModelSetStatus
from engine.core.stats import QuietObserver
from engine.logs import REQUEST
from engine.request import PartialImage, RequestBatch, RequestOutput
from engine.spec import PipelineSpec
from server.api_servers.channel import Channel, ChannelClosedError
from server.api_servers.messages import (
    Abort,
    AdmitKey,
    Admitted,
    AskMetrics,
    CacheGet,
    CachePut,
    ChargeKey,
    Claim,
    Claimed,
    Finished,
    ForRequest,
    Progress,
    Release,
    ReleaseKey,
    Reply,
    Snapshot,
    Started,
    Submit,
)
from server.key_limits import KeyLimits
from server.result_cache import CachedImages, ResultCache

logger = logging.getLogger(__name__)

# What `/health` reads of the engine (`EngineHost._health`): sent again when it changes.
_Health = tuple[bool, str | None, str | None, WorkerHealth, ModelSetStatus | None]

# How often each connection hears the engine's state (its /health and waiting gauges).
SNAPSHOT_PERIOD_S = 0.25
# Who answered, in `Finished` (Ray's replica id; one engine process here).
ENGINE_ID = "engine"


class EngineHost:
    """`key_limits` and `result_cache`: the server's, counted and kept here for every API
    process (`server.api_servers.key_limits_client`, `result_cache_client`)."""

    def __init__(
        self,
        engine: EngineService,
        metrics_text: Callable[[], bytes],
        key_limits: KeyLimits | None = None,
        result_cache: ResultCache | None = None,
    ) -> None:
        self._engine = engine
        self._metrics_text = metrics_text
        self._shared = _Shared(key_limits or KeyLimits(), result_cache)
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._health_sent: _Health | None = None
        engine.observers.append(_ProgressRelay(self._connections))

    async def listen(self, path: Path) -> None:
        """Accept the API processes' connections on the Unix socket `path`."""
        path.unlink(missing_ok=True)  # the socket of an engine process that died
        self._server = await asyncio.start_unix_server(self._accept, path=str(path))
        self._ticker = asyncio.create_task(self._tick(), name="diffbatch-engine-snapshots")

    @property
    def connections(self) -> int:
        """The API processes connected now."""
        return len(self._connections)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(
            Channel(reader, writer), self._engine, self._metrics_text, self._moved, self._shared
        )
        self._connections.add(connection)
        try:
            await connection.serve()
        finally:
            self._connections.discard(connection)

    async def _tick(self) -> None:
        while True:
            self._broadcast()
            await asyncio.sleep(SNAPSHOT_PERIOD_S)

    def _broadcast(self) -> None:
        self._health_sent = self._health()
        for connection in list(self._connections):
            connection.send_snapshot()

    def _moved(self) -> None:
        """Before an answer (a request's end, a claim's reply): if what `/health` says has
        changed since the last snapshot (a worker died or came back, a model loaded or
        failed to), every API process hears it before the caller gets its answer."""
        if self._health() != self._health_sent:
            self._broadcast()

    def _health(self) -> _Health:
        engine = self._engine
        return (
            engine.is_running,
            engine.failure,
            engine.unavailable,
            engine.worker_health(),
            engine.model_set_status(),
        )


@dataclass(frozen=True, slots=True)
class _Shared:
    """What every connection counts and keeps in common."""

    key_limits: KeyLimits
    result_cache: ResultCache | None


class _Connection:
    """One API process: its requests in flight (by id), its claims and its keys' tickets."""

    def __init__(
        self,
        channel: Channel,
        engine: EngineService,
        metrics_text: Callable[[], bytes],
        moved: Callable[[], None],
        shared: _Shared,
    ) -> None:
        self._channel = channel
        self._engine = engine
        self._metrics_text = metrics_text
        self._moved = moved  # told before each answer (`EngineHost._moved`)
        self._shared = shared
        # Each request's count against its key (`AdmitKey`), until a `Submit` takes it over.
        self._tickets: dict[int, Callable[[], None]] = {}
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._handles: dict[str, RequestHandle] = {}
        self.wants_progress: set[str] = set()
        self._claims: dict[int, EngineService] = {}
        self._claim_ids = itertools.count(1)
        self._calls: set[asyncio.Task[None]] = set()
        self._spec_sent: object = None  # the engine's own spec object last sent (as weightless)
        self._specs_sent: dict[str, int] = {}  # of several models: the engine each spec was of

    async def serve(self) -> None:
        self.send_snapshot()
        try:
            while True:
                message = await self._channel.receive()
                self._dispatch(message)
        except ChannelClosedError:
            pass
        finally:
            self._gone()

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Submit):
            # In a context of its own, bound to the request's log fields as its API process
            # bound them: the engine's lines about it (and its pump's) say them too.
            context = contextvars.copy_context()
            context.run(REQUEST.set, message.log_context)
            context.run(self._submit, message)
        elif isinstance(message, Abort):
            handle = self._handles.get(message.request_id)
            if handle is not None:
                handle.abort()  # its pump then ends quietly: the client has settled it
        elif isinstance(message, Claim):
            self._call(message.call_id, self._claim(message))
        elif isinstance(message, Release):
            self._claims.pop(message.claim_id, None)  # the claim ends as the engine is dropped
        elif isinstance(message, AskMetrics):
            self._call(message.call_id, asyncio.to_thread(self._metrics_text))
        elif isinstance(message, AdmitKey | ReleaseKey | ChargeKey | CacheGet | CachePut):
            self._dispatch_shared(message)
        else:
            logger.error("the engine process got a message it does not know: %r", type(message))

    def _dispatch_shared(self, message: AdmitKey | ReleaseKey | ChargeKey | CacheGet | CachePut) -> None:
        """A key's count, or the result cache (`_Shared`)."""
        limits, cache = self._shared.key_limits, self._shared.result_cache
        if isinstance(message, ReleaseKey):
            release = self._tickets.pop(message.ticket, None)
            if release is not None:
                release()
            return
        work: Awaitable[CachedImages | int | None]
        if isinstance(message, AdmitKey):
            work = self._admit_key(message)
        elif isinstance(message, ChargeKey):
            work = limits.charge(limits.key_named(message.key))
        elif cache is None:  # not asked by API processes of these settings: a miss, nothing kept
            work = _nothing_cached()
        elif isinstance(message, CacheGet):
            work = cache.get(message.key)
        else:
            work = cache.put(message.key, message.entry)
        self._call(message.call_id, work)

    async def _admit_key(self, message: AdmitKey) -> int:
        limits = self._shared.key_limits
        self._tickets[message.call_id] = await limits.admit(limits.key_named(message.key))
        return message.call_id

    def _submit(self, message: Submit) -> None:
        request = message.request
        engine = self._engine if message.claim_id is None else self._claims.pop(message.claim_id, None)
        release = None if message.ticket is None else self._tickets.pop(message.ticket, None)
        try:
            if engine is None:
                raise RuntimeError(f"claim {message.claim_id} of request {request.request_id} is unknown")
            handle = engine.submit(request)
        except Exception as exc:  # noqa: BLE001 - refused (queue full, duplicate id): said as the answer
            if release is not None:
                release()  # never held: its key's count drops before the refusal is sent
            self._send(ForRequest(request.request_id, Finished(ENGINE_ID, error=exc)))
            return
        if release is not None:
            # Dropped where the request ends, before its answer is sent, as in one process.
            handle.add_done_callback(release)
        self._handles[request.request_id] = handle
        if message.progress:
            self.wants_progress.add(request.request_id)
        self._send(ForRequest(request.request_id, Admitted()))
        self._pumps[request.request_id] = asyncio.create_task(
            self._pump(handle), name=f"diffbatch-ipc-{request.request_id}"
        )

    async def _pump(self, handle: RequestHandle) -> None:
        """The request's previews, then its end, to the API process that sent it."""
        request_id = handle.request_id
        end: Finished
        try:
            async for event in handle.events():
                if isinstance(event, PartialImage):
                    self._send(ForRequest(request_id, event))
                elif isinstance(event, RequestOutput):
                    end = Finished(ENGINE_ID, output=event)
                    break
            else:
                end = Finished(
                    ENGINE_ID, error=RuntimeError("the engine ended the request without an answer")
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's error is the answer
            end = Finished(ENGINE_ID, error=exc)
        finally:
            self._handles.pop(request_id, None)
            self._pumps.pop(request_id, None)
            self.wants_progress.discard(request_id)
        self._moved()
        self._send(ForRequest(request_id, end))
        with contextlib.suppress(ConnectionError):
            await self._channel.drain()  # a slow reader slows its own answers, not the engine

    async def _claim(self, message: Claim) -> Claimed:
        engine = await self._engine.engine_for(message.model, message.timeout_s)
        claim_id = next(self._claim_ids)
        self._claims[claim_id] = engine
        status = self._engine.model_set_status()
        name = message.model or (next(iter(status.models)) if status is not None else "")
        # A model loaded again has a new spec object (perhaps another spec).
        raw = getattr(engine, "spec", None)
        version = id(raw)
        spec = None if self._specs_sent.get(name) == version else _weightless(raw)
        self._specs_sent[name] = version
        return Claimed(claim_id, name, engine.modality, version, spec)

    def _call(self, call_id: int, work: Awaitable[Claimed | bytes | CachedImages | int | None]) -> None:
        async def answer() -> None:
            try:
                reply = Reply(call_id, value=await work)
            except Exception as exc:  # noqa: BLE001 - the caller's error
                reply = Reply(call_id, error=exc)
            self._moved()
            self._send(reply)

        task = asyncio.create_task(answer())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def send_snapshot(self) -> None:
        engine = self._engine
        raw = getattr(engine, "spec", None)  # a model set has none: each claim brings its own
        changed = raw is not None and raw is not self._spec_sent
        if changed:
            self._spec_sent = raw
        self._send(
            Snapshot(
                is_running=engine.is_running,
                failure=engine.failure,
                unavailable=engine.unavailable,
                workers_up=engine.workers_up,
                workers=engine.worker_health(),
                modality=engine.modality,
                batching=str(getattr(engine, "batching", "")),
                num_waiting=engine.num_waiting,
                num_running=engine.num_running,
                num_unfinished=engine.num_unfinished,
                input_bytes=engine.input_bytes,
                weight_bytes=engine.weight_bytes,
                profile=engine.profile,
                models=engine.model_set_status(),
                spec=_weightless(raw) if changed else None,
            )
        )

    def send_progress(self, request_id: str, done: int, total: int) -> None:
        self._send(ForRequest(request_id, Progress(done, total)))

    def send_started(self, request_id: str) -> None:
        self._send(ForRequest(request_id, Started()))

    def _send(self, message: object) -> None:
        with contextlib.suppress(ChannelClosedError):
            self._channel.send(message)

    def close(self) -> None:
        self._channel.close()

    def _gone(self) -> None:
        """The API process went away: its requests end here too."""
        pending = list(self._handles.values())
        if pending:
            logger.warning("an API process went away: aborting its %d requests", len(pending))
        for handle in pending:
            handle.abort()  # each pump then ends by itself, its answer sent nowhere
        for task in self._calls:
            task.cancel()
        tickets, self._tickets = self._tickets, {}
        for release in tickets.values():
            release()  # counted, never submitted: the requests went with their process
        self._claims.clear()
        self._channel.close()


class _ProgressRelay(QuietObserver):
    """The engine's observer that sends a batch's start and each step's progress to the
    connections whose requests asked for them (video jobs: their status and `progress`)."""

    def __init__(self, connections: set[_Connection]) -> None:
        self._connections = connections

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        for connection in self._connections:
            for request_id in request_ids:
                if request_id in connection.wants_progress:
                    connection.send_progress(request_id, done, total)

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        for connection in self._connections:
            for request_id in batch.request_ids:
                if request_id in connection.wants_progress:
                    connection.send_started(request_id)


async def _nothing_cached() -> None:
    return None


def _weightless(spec: object) -> PipelineSpec | None:
    """The spec to send: an in-process pipeline's weightless copy (`Pipeline.spec()`), a
    worker's spec (weightless already) as it is."""
    if spec is None:
        return None
    to_spec = getattr(spec, "spec", None)
    return cast("PipelineSpec", to_spec() if callable(to_spec) else spec)
