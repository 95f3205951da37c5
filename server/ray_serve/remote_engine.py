"""`RemoteEngine`: the engine as the gateway sees it when the engines are Ray Serve replicas.

It admits each request itself (the model's defaults, a seed, 400s for bad input: the same
`admitted` as `AsyncEngine`, over the replica's weightless `PipelineSpec`), then sends it as
one streamed call to the replicas through the batch-key router, and hands the caller the
same `RequestHandle` a local engine would. Previews arrive on the stream, then the output.

Failures: a replica's answer carries the engine's own error (the same HTTP status as with
one server); Serve's load shedding (`max_queued_requests`) is a 429 with Retry-After; a
replica that died is a 503 `worker_restarting` (Serve starts a new one), or with
`retry_on_worker_crash` one more try on another replica. Cancelling the handle (the client
went away, a deadline, DELETE of a video job) cancels the call, which aborts the request
on its replica.

Health: `/health` and the waiting gauge read the replicas through a `ReplicaWatch`
(Serve's replica states, the replicas' routing stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any, cast

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from engine.core.admission import admitted
from engine.core.handle import RequestHandle, settle
from engine.core.inputs import InputLedger, prepared_inputs
from engine.core.lanes import Lane, WorkerHealth
from engine.core.stats import EngineObserver
from engine.errors import EngineNotRunningError, QueueFullError, RequestAbortedError, WorkerCrashedError
from engine.request import BatchKey, GenerationRequest, PartialImage, RequestOutput
from engine.spec import PipelineSpec
from engine.worker.profile_run import ProfileResult
from server.composition import import_ahead
from server.ray_serve.messages import Finished, Progress, RemoteCall, ReplicaInfo
from server.ray_serve.watch import ReplicaWatch
from server.settings import ServeSettings

logger = logging.getLogger(__name__)

_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
# What every diffusers-based pipeline spec is built on (the adapter's module imports torch,
# diffusers and transformers): named, not imported, as the gateway's own code needs none of it.
SPEC_MODULE = "pipelines.adapter"


class RemoteEngine:
    def __init__(
        self, replicas: DeploymentHandle[Any], settings: ServeSettings, watch: ReplicaWatch | None = None
    ) -> None:
        self.observers: list[EngineObserver] = []
        self.failure: str | None = None
        self.profile: ProfileResult | None = None  # each replica profiles its own device
        self._replicas = replicas
        self._settings = settings
        self._watch = watch
        self._info: ReplicaInfo | None = None
        self._inputs = InputLedger(settings.engine_config().max_input_bytes)
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._partials: dict[str, asyncio.Queue[PartialImage]] = {}
        self._running = False
        self._answers: dict[str, int] = {}

    async def start(self) -> None:
        # Reading a replica's description imports what its pipeline spec is made of (torch,
        # diffusers: seconds, on the event loop, where every request then waits); imported in
        # a thread first, while the replicas still load, and not both at once (two threads
        # importing one package can deadlock on its modules' locks).
        await asyncio.to_thread(import_ahead, SPEC_MODULE)
        self._info = await self._replicas.describe.remote()
        if self._watch is not None:
            await self._watch.start()
        self._running = True
        logger.info("engine replicas ready (%s batching)", self._info.batching)

    async def stop(self) -> None:
        self._running = False
        if self._watch is not None:
            await self._watch.stop()
        for request_id in list(self._calls):
            self._abort(request_id, EngineNotRunningError("the server is shutting down"))

    @property
    def _spec(self) -> PipelineSpec:
        if self._info is None:
            raise EngineNotRunningError("the engine is not running")
        return self._info.spec

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if not self._running:
            raise EngineNotRunningError("the engine is not running")
        spec = self._spec
        request = admitted(spec, request)
        limit = self._settings.max_queue_len
        if len(self._calls) >= limit:
            raise QueueFullError(limit, 1.0)
        self._inputs.hold(request, limit, lambda: 1.0)
        step = self._info is not None and self._info.batching == "step"
        call = RemoteCall(request, spec.step_key(request) if step else spec.batch_key(request))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RequestOutput] = loop.create_future()
        partials: asyncio.Queue[PartialImage] = asyncio.Queue()
        self._futures[request.request_id] = future
        self._partials[request.request_id] = partials
        self._calls[request.request_id] = loop.create_task(
            self._call(call), name=f"diffbatch-{request.request_id}"
        )
        return RequestHandle(request, future, partials, self.abort)

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        return await self.submit(request).result()

    async def prepare_inputs(self, request: GenerationRequest) -> GenerationRequest:
        if self._info is None or not request.has_inputs:
            return request
        return await asyncio.to_thread(prepared_inputs, self._spec, request)

    def abort(self, request_id: str, error: Exception | None = None) -> bool:
        return self._abort(request_id, error or RequestAbortedError(f"request {request_id} was aborted"))

    def abort_all(self, error: Exception) -> int:
        return sum(self._abort(request_id, error) for request_id in list(self._calls))

    def _abort(self, request_id: str, error: Exception) -> bool:
        task = self._calls.get(request_id)
        if task is None:
            return False
        task.cancel()  # cancels the replica's call: the request leaves its engine
        for observer in self.observers:
            observer.on_abort(request_id)
        self._end(request_id, error)
        return True

    async def _call(self, call: RemoteCall) -> None:
        request_id = call.request.request_id
        tries = 2 if self._settings.retry_on_worker_crash else 1
        for attempt in range(tries):
            try:
                await self._stream(call)
                return
            except asyncio.CancelledError:
                raise
            except BackPressureError as exc:
                retry_after = float(getattr(exc, "retry_after_s", None) or 1.0)
                self._end(
                    request_id, QueueFullError(0, retry_after, "every engine replica is full; retry later")
                )
                return
            except _REPLICA_GONE as exc:
                if attempt + 1 < tries:
                    logger.warning("request %s lost its replica (%s); sending it once more", request_id, exc)
                    continue
                self._end(request_id, WorkerCrashedError(f"the engine replica serving it died: {exc}"))
                return
            except Exception as exc:
                logger.exception("request %s failed on its way to a replica", request_id)
                self._end(request_id, EngineNotRunningError(f"no engine replica answered: {exc}"))
                return

    async def _stream(self, call: RemoteCall) -> None:
        request_id = call.request.request_id
        stream = cast(DeploymentResponseGenerator[Any], self._replicas.options(stream=True).run.remote(call))
        try:
            async for event in stream:
                if isinstance(event, PartialImage):
                    queue = self._partials.get(request_id)
                    if queue is not None:
                        queue.put_nowait(event)
                elif isinstance(event, Progress):
                    for observer in self.observers:
                        observer.on_progress([request_id], event.done, event.total)
                elif isinstance(event, Finished):
                    self._finished(request_id, event)
        finally:
            with contextlib.suppress(Exception):
                stream.cancel()  # type: ignore[no-untyped-call]

    def _finished(self, request_id: str, event: Finished) -> None:
        self._answers[event.replica_id] = self._answers.get(event.replica_id, 0) + 1
        for observer in self.observers:
            for record in event.forwards:
                observer.on_forward(record)
            for decode in event.decodes:
                observer.on_decode(decode)
            for moderation in event.moderations:
                observer.on_moderation(moderation)
        if event.output is not None:
            self._end(request_id, event.output)
        else:
            self._end(request_id, event.error or RuntimeError("the replica returned nothing"))

    def _end(self, request_id: str, outcome: RequestOutput | Exception) -> None:
        self._inputs.release(request_id)
        self._calls.pop(request_id, None)
        self._partials.pop(request_id, None)
        settle(self._futures.pop(request_id, None), outcome)

    # What /health and /metrics read --------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def modality(self) -> str:
        return self._info.spec.modality if self._info is not None else "unknown"

    @property
    def unavailable(self) -> str | None:
        """Why no replica can take a request just now (none is RUNNING), or None."""
        return self._watch.unavailable if self._watch is not None else None

    @property
    def workers_up(self) -> int:
        """The engine replicas RUNNING (this process has no worker of its own)."""
        return self._watch.running if self._watch is not None else 0

    @property
    def lanes(self) -> list[Lane]:
        return []

    def worker_health(self) -> WorkerHealth:
        return WorkerHealth(0, 0)  # the replicas' own: `workers_up` counts those running

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the replicas' engines, as of their last routing stats."""
        return self._watch.waiting if self._watch is not None else 0

    @property
    def num_running(self) -> int:
        """Requests sent to the replicas and not yet answered."""
        return len(self._calls)

    @property
    def num_unfinished(self) -> int:
        return len(self._calls)

    @property
    def weight_bytes(self) -> int:
        return 0  # each replica holds its own

    async def engine_for(self, name: str | None, timeout_s: float | None = None) -> RemoteEngine:
        return self  # one model's deployment (Serve routes to a replica that has it)

    def model_set_status(self) -> None:
        return None  # one model: its state is the engine's own

    # No lanes here: each replica counts its own (the gateway counts `answers_by_replica`).

    def lane_counts(self) -> dict[str, tuple[float, int]]:
        return {}

    def worker_counts(self) -> Counter[str]:
        return Counter()

    def step_counter(self, name: str) -> int:
        return 0

    @property
    def input_bytes(self) -> int:
        return self._inputs.total

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return {}

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        return {}  # counted in each replica's engine; not relayed to the gateway yet

    @property
    def prompt_cache(self) -> dict[str, float]:
        return {}  # kept in each replica's workers; not relayed to the gateway yet

    @property
    def answers_by_replica(self) -> dict[str, int]:
        return dict(self._answers)
