"""`EngineClient`: the engine as an API process sees it — `EngineService` over the socket to
the engine process (`host.EngineHost`), as the Ray gateway's `RemoteEngine` is over Ray.

It admits each request itself first (the model's defaults, a seed, 400s for bad input: the
same `admitted` as `AsyncEngine`, over the weightless spec the engine process sent), so bad
input is refused in `submit` as in one process; the engine process then admits it for good
(a full queue, a duplicate id, a deadline it cannot meet), which `RequestHandle.accepted`
waits for. Previews, a video's progress and the end arrive on the connection.

Its state (`/health`, `/v1/models`, the routes' checks) is the engine's last `Snapshot`,
a quarter-second old at most. With several models, `engine_for` claims the model in the
engine process (loading it there if need be) and hands out a `ClaimedModel`.

The engine process dying (or restarting) ends every request in flight with
`EngineRestartingError` (503 `engine_restarting`: nothing is sent twice), new requests get
the same until it is back, and the client connects again by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.core.admission import admitted
from engine.core.handle import RequestHandle, settle
from engine.core.inputs import prepared_inputs
from engine.core.lanes import Lane, WorkerHealth
from engine.core.service import EngineService, ModelSetStatus, ModelStatus
from engine.core.stats import EngineObserver
from engine.errors import (
    DuplicateRequestError,
    EngineNotRunningError,
    EngineRestartingError,
    RequestAbortedError,
)
from engine.logs import REQUEST
from engine.request import BatchKey, GenerationRequest, PartialImage, RequestBatch, RequestOutput
from engine.spec import PipelineSpec
from engine.worker.profile_run import ProfileResult
from server.api_servers.channel import Channel, ChannelClosedError
from server.api_servers.messages import (
    Abort,
    Admitted,
    AskMetrics,
    Claim,
    Claimed,
    Finished,
    ForRequest,
    Progress,
    Release,
    Reply,
    Snapshot,
    Started,
    Submit,
)

logger = logging.getLogger(__name__)

# Between two tries to reach the engine process's socket.
RECONNECT_S = 0.05
# Longest wait for the engine process to answer a call that loads nothing (the metrics text).
CALL_TIMEOUT_S = 30.0
RESTARTING = "the engine process stopped and is being restarted; send the request again"


class EngineClient:
    def __init__(self, path: Path, model_names: tuple[str, ...] = ()) -> None:
        self.observers: list[EngineObserver] = []
        self.failure: str | None = None
        self.profile: ProfileResult | None = None
        self._path = path
        self._model_names = model_names  # several models: their names, before the first snapshot
        self._channel: Channel | None = None
        self._link: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._ever_connected = False
        self._stopping = False
        self._snapshot: Snapshot | None = None
        self._spec: PipelineSpec | None = None
        self._model_specs: dict[str, tuple[int, PipelineSpec]] = {}
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._partials: dict[str, asyncio.Queue[PartialImage]] = {}
        self._accepted: dict[str, asyncio.Future[None]] = {}
        self._requests: dict[str, GenerationRequest] = {}  # as admitted, for the observers
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Connect (waiting for the engine process to listen); its model may still be loading."""
        self._loop = asyncio.get_running_loop()
        self._link = asyncio.create_task(self._keep_linked(), name="diffbatch-engine-link")
        await self._connected.wait()

    async def stop(self) -> None:
        self._stopping = True
        if self._link is not None:
            self._link.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._link
        self._lost(EngineNotRunningError("the server is shutting down"))

    async def _keep_linked(self) -> None:
        while not self._stopping:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self._path))
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            channel = Channel(reader, writer)
            self._channel = channel
            try:
                await self._read(channel)  # the first snapshot sets `_connected`
            except ChannelClosedError:
                if not self._stopping:
                    logger.error("lost the engine process: requests in flight end with 503; reconnecting")
            finally:
                self._channel = None
                self._connected.clear()
                channel.close()
                self._lost(EngineRestartingError(RESTARTING))

    async def _read(self, channel: Channel) -> None:
        while True:
            message = await channel.receive()
            if isinstance(message, ForRequest):
                self._on_event(message.request_id, message.event)
            elif isinstance(message, Snapshot):
                self._on_snapshot(message)
            elif isinstance(message, Reply):
                self._on_reply(message)

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.spec is not None:
            self._spec = snapshot.spec
        self._snapshot = snapshot
        self.failure = snapshot.failure
        self.profile = snapshot.profile
        if not self._connected.is_set():
            self._ever_connected = True
            self._connected.set()
            logger.info("connected to the engine process")

    def _on_event(self, request_id: str, event: object) -> None:
        if isinstance(event, Admitted):
            accepted = self._accepted.get(request_id)
            if accepted is not None and not accepted.done():
                accepted.set_result(None)
        elif isinstance(event, PartialImage):
            queue = self._partials.get(request_id)
            if queue is not None:
                queue.put_nowait(event)
        elif isinstance(event, Started):
            request = self._requests.get(request_id)
            if request is not None:
                batch = RequestBatch((), (request,))  # what the video jobs read of it: its id
                for observer in self.observers:
                    observer.on_batch_start(batch, time.monotonic())
        elif isinstance(event, Progress):
            for observer in self.observers:
                observer.on_progress([request_id], event.done, event.total)
        elif isinstance(event, Finished):
            outcome = event.output if event.output is not None else event.error
            self._end(request_id, outcome or RuntimeError("the engine process answered nothing"))

    def _on_reply(self, reply: Reply) -> None:
        future = self._calls.pop(reply.call_id, None)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(reply.error)
        else:
            future.set_result(reply.value)

    def _lost(self, error: Exception) -> None:
        """Every request and call in flight ends with `error` (the link went away)."""
        for request_id in list(self._futures):
            self._end(request_id, error)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    def _end(self, request_id: str, outcome: RequestOutput | Exception) -> None:
        self._partials.pop(request_id, None)
        self._requests.pop(request_id, None)
        future = self._futures.pop(request_id, None)
        settle(future, outcome)
        accepted = self._accepted.pop(request_id, None)
        if accepted is None or accepted.done():
            return
        if isinstance(outcome, Exception):
            # Refused: its owner hears it from `accepted` or `result`, whichever it awaits (a
            # local engine raises it at `submit`); neither is logged as an unread error.
            accepted.set_exception(outcome)
            for unread in (accepted, future):
                if unread is not None and unread.done() and not unread.cancelled():
                    unread.exception()
        else:
            accepted.set_result(None)

    def _live_channel(self) -> Channel:
        channel = self._channel
        if channel is None or not self._connected.is_set():
            if self._ever_connected and not self._stopping:
                raise EngineRestartingError(RESTARTING)
            raise EngineNotRunningError("the engine is not running")
        return channel

    async def call(
        self, message_of: Callable[[int], object], timeout_s: float | None = CALL_TIMEOUT_S
    ) -> Any:
        """Send the call `message_of(call_id)` and await its `Reply`'s value (or its error).
        Each call has an id of its own, never given again by this client (a key's ticket is
        its `AdmitKey`'s id: one an engine process started since cannot mistake)."""
        channel = self._live_channel()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            channel.send(message_of(call_id))
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            self._calls.pop(call_id, None)

    # EngineService ----------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        *,
        claim_id: int | None = None,
        spec: PipelineSpec | None = None,
        modality: str | None = None,
        ticket: int | None = None,
    ) -> RequestHandle:
        """Send `request` (of the claim `claim_id` with `spec`, where there are several models;
        counted for its key under `ticket`, `server.api_servers.key_limits_client`)."""
        try:
            channel = self._live_channel()
            spec = spec or self._spec
            if spec is None:
                raise EngineNotRunningError("the engine is not running")
            request = admitted(spec, request)
            if request.request_id in self._futures:
                raise DuplicateRequestError(request.request_id)
        except BaseException:
            if claim_id is not None:
                self.release_claim(claim_id)
            raise
        request_id = request.request_id
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RequestOutput] = loop.create_future()
        accepted: asyncio.Future[None] = loop.create_future()
        partials: asyncio.Queue[PartialImage] = asyncio.Queue()
        self._futures[request_id] = future
        self._accepted[request_id] = accepted
        self._partials[request_id] = partials
        self._requests[request_id] = request
        # Progress only for video jobs (their `progress`); an image's steps are not watched.
        progress = (modality or self.modality) == "video"
        channel.send(Submit(request, claim_id, progress, ticket, REQUEST.get()))
        return RequestHandle(request, future, partials, self.abort, accepted)

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        return await self.submit(request).result()

    async def prepare_inputs(
        self, request: GenerationRequest, spec: PipelineSpec | None = None
    ) -> GenerationRequest:
        spec = spec or self._spec
        if spec is None or not request.has_inputs:
            return request
        return await asyncio.to_thread(prepared_inputs, spec, request)

    def abort(self, request_id: str, error: Exception | None = None) -> bool:
        if request_id not in self._futures:
            return False
        channel = self._channel
        if channel is not None:
            with contextlib.suppress(ChannelClosedError):
                channel.send(Abort(request_id))  # the engine process counts the abort
        self._end(request_id, error or RequestAbortedError(f"request {request_id} was aborted"))
        return True

    def abort_all(self, error: Exception) -> int:
        return sum(self.abort(request_id, error) for request_id in list(self._futures))

    async def engine_for(self, name: str | None, timeout_s: float | None = None) -> EngineService:
        if not self._model_names:
            return self
        claimed: Claimed = await self.call(
            lambda call_id: Claim(call_id, name, timeout_s),
            None if timeout_s is None else timeout_s + CALL_TIMEOUT_S,
        )
        if claimed.spec is not None:
            self._model_specs[claimed.model] = (claimed.spec_version, claimed.spec)
        version, spec = self._model_specs[claimed.model]
        assert version == claimed.spec_version, "the engine process sent no spec for this model"
        return ClaimedModel(self, claimed, spec)  # EngineService by delegation (`__getattr__`)

    def release_claim(self, claim_id: int) -> None:
        self.tell(Release(claim_id))

    def tell(self, message: object) -> None:
        """Send `message`, which has no answer, if the engine process is there: one that is
        not has dropped whatever the message would drop."""
        channel = self._channel
        if channel is not None:
            with contextlib.suppress(ChannelClosedError):
                channel.send(message)

    async def metrics_text(self) -> bytes:
        """The engine process's live collectors (`server.metrics`); none while it is away."""
        try:
            text: bytes = await self.call(AskMetrics)
        except (EngineNotRunningError, EngineRestartingError, TimeoutError):
            return b""
        return text

    def model_set_status(self) -> ModelSetStatus | None:
        if not self._model_names:
            return None
        snapshot = self._snapshot
        if snapshot is not None and snapshot.models is not None:
            return snapshot.models
        unloaded = ModelStatus("unloaded", "unknown", None, 0, 0, 0, 0, 0)
        return ModelSetStatus(dict.fromkeys(self._model_names, unloaded), 0, None, 0, None)

    # What /health and the routes read: the engine's last snapshot ----------------------

    @property
    def is_running(self) -> bool:
        return self._snapshot is not None and self._snapshot.is_running

    @property
    def modality(self) -> str:
        return self._snapshot.modality if self._snapshot is not None else "unknown"

    @property
    def unavailable(self) -> str | None:
        if not self._connected.is_set() and self._ever_connected:
            return RESTARTING
        return self._snapshot.unavailable if self._snapshot is not None else None

    @property
    def workers_up(self) -> int:
        return self._snapshot.workers_up if self._snapshot is not None else 0

    @property
    def lanes(self) -> list[Lane]:
        return []  # in the engine process

    def worker_health(self) -> WorkerHealth:
        return self._snapshot.workers if self._snapshot is not None else WorkerHealth(0, 0)

    @property
    def num_waiting(self) -> int:
        return self._snapshot.num_waiting if self._snapshot is not None else 0

    @property
    def num_running(self) -> int:
        return self._snapshot.num_running if self._snapshot is not None else 0

    @property
    def num_unfinished(self) -> int:
        return self._snapshot.num_unfinished if self._snapshot is not None else 0

    @property
    def input_bytes(self) -> int:
        return self._snapshot.input_bytes if self._snapshot is not None else 0

    @property
    def weight_bytes(self) -> int:
        return self._snapshot.weight_bytes if self._snapshot is not None else 0

    # Counted in the engine process, whose /metrics text carries them (`metrics_text`).

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return {}

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        return {}

    @property
    def prompt_cache(self) -> dict[str, float]:
        return {}

    @property
    def answers_by_replica(self) -> dict[str, int]:
        return {}

    def lane_counts(self) -> dict[str, tuple[float, int]]:
        return {}

    def worker_counts(self) -> Counter[str]:
        return Counter()

    def step_counter(self, name: str) -> int:
        return 0


class ClaimedModel:
    """One of several models' engines, claimed in the engine process for one request (as
    `engine.models.claimed_engine.ClaimedEngine` is there): `submit` hands the claim over,
    and a claim dropped without a submit is released when this object is collected."""

    def __init__(self, client: EngineClient, claimed: Claimed, spec: PipelineSpec) -> None:
        self._client = client
        self._claim_id = claimed.claim_id
        self._spec = spec
        self.modality = claimed.modality
        self._release = weakref.finalize(self, _release_soon, weakref.ref(client), claimed.claim_id)

    def submit(self, request: GenerationRequest, *, ticket: int | None = None) -> RequestHandle:
        self._release.detach()  # from here the claim is the submit's (sent, or released on refusal)
        return self._client.submit(
            request, claim_id=self._claim_id, spec=self._spec, modality=self.modality, ticket=ticket
        )

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        return await self.submit(request).result()

    async def prepare_inputs(self, request: GenerationRequest) -> GenerationRequest:
        return await self._client.prepare_inputs(request, self._spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _release_soon(client: weakref.ref[EngineClient], claim_id: int) -> None:
    """Release a claim from a finalizer, which may run in any thread: on the loop's next turn."""
    owner = client()
    loop = None if owner is None else owner._loop
    if owner is None or loop is None:
        return
    with contextlib.suppress(RuntimeError):  # the loop has closed: the link has gone with it
        loop.call_soon_threadsafe(owner.release_claim, claim_id)
