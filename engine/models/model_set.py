"""`ModelSet`: several served models in one server, each with its own engine, loaded on first
use and unloaded by memory.

Every model has its own `AsyncEngine` (scheduler, queue, lanes), so batch keys of two models
never mix; the server routes a request by its `model` through `engine_for`. Which models stay
loaded is `Residency`'s choice under one budget: before a load, the least recently used idle
models are unloaded (parked in host memory when a host budget has room and the model can
move, `engine.models.host_parking`; else dropped: their engines stop, their weights go); a model
that runs or has requests queued is never unloaded, so a load that cannot fit waits for one
to go idle, bounded by the waiting request's deadline. A model whose load fails fails only its own
requests, with the reason, and is tried again no sooner than `retry_failed_s` later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import cast

from engine.core.handle import RequestHandle
from engine.core.lanes import Lane, WorkerHealth, worker_health
from engine.core.service import EngineService, ModelSetStatus
from engine.core.stats import EngineObserver
from engine.errors import EngineNotRunningError, ModelUnavailableError
from engine.models.claimed_engine import ClaimedEngine
from engine.models.engine_totals import EngineTotals, RetiredTotals, SharedReplicas
from engine.models.model_room import ModelRoom
from engine.models.model_slot import ModelSlot
from engine.models.residency import Residency
from engine.request import BatchKey, GenerationRequest, RequestOutput
from engine.worker.profile_run import ProfileResult

__all__ = ["ModelSet", "ModelSlot"]  # the slot is defined in engine.models.model_slot

logger = logging.getLogger(__name__)


class ModelSet:
    """The served models by name; `default` answers requests that name none. It holds a
    `ModelRoom` (unloading to make room, parking) and an `EngineTotals` (the loaded engines
    together, as the server's one `EngineService`)."""

    def __init__(
        self,
        slots: list[ModelSlot],
        budget_bytes: int | None = None,
        *,
        retry_failed_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        shared_replicas: SharedReplicas | None = None,
        host_budget_bytes: int | None = None,
    ) -> None:
        if not slots:
            raise ValueError("a model set needs at least one model")
        self.slots = {slot.name: slot for slot in slots}
        self.default = slots[0].name
        self.residency = Residency(budget_bytes, host_budget_bytes)
        self.observers: list[EngineObserver] = []  # given to every engine it makes
        # What unloaded engines counted (counters never drop); with Ray multiplexing, the
        # replicas all models share.
        self._totals = EngineTotals(self.slots, RetiredTotals(), shared_replicas)
        self.profile: ProfileResult | None = None  # each model's engine profiles its own start
        # A model that fails to load fails its own requests (`/health` names it); the server
        # as a whole serves on.
        self.failure: str | None = None
        self._retry_failed_s = retry_failed_s
        self.clock = clock
        # One load or unload at a time: each decides on the memory the others leave.
        self._lock = asyncio.Lock()
        self._room = ModelRoom(self.slots, self.residency, self._totals.retired, clock, self._lock)
        # Running once the preloads are done (`/health` says ok only then) until stopped.
        self._running = False
        # One per request waiting for a model's load: `abort_all` ends them with its error.
        self._waiters: set[asyncio.Future[None]] = set()

    @property
    def is_running(self) -> bool:
        return self._running

    async def start(self) -> None:
        """Load the models marked `preload` (a failure is that model's, logged, not raised)."""
        preload = [slot for slot in self.slots.values() if slot.preload]
        await asyncio.gather(*(self._ensure(slot) for slot in preload), return_exceptions=True)
        self._running = True

    def abort_all(self, error: Exception) -> int:
        """End every request with `error`: those in the loaded engines, and those still
        waiting for their model's load (each once: it leaves the waiters as it is ended)."""
        waiting = [waiter for waiter in self._waiters if not waiter.done()]
        for waiter in waiting:
            waiter.set_exception(error)
        return self._totals.abort_all(error) + len(waiting)

    async def stop(self) -> None:
        self._running = False
        for slot in self.slots.values():
            if slot.loading is not None:
                slot.loading.cancel()
        engines = [slot.engine for slot in self.slots.values() if slot.engine is not None]
        await asyncio.gather(*(engine.stop() for engine in engines), return_exceptions=True)
        for engine in engines:
            self._totals.retired.add(engine)
        for slot in self.slots.values():
            slot.engine, slot.state = None, "unloaded"

    def loaded_engines(self) -> list[tuple[str, EngineService]]:
        return [(slot.name, slot.engine) for slot in self.slots.values() if slot.engine is not None]

    async def engine_for(self, name: str | None, timeout_s: float | None = None) -> EngineService:
        """The engine of model `name` (the default for None), loading it first if need be
        (waiting at most `timeout_s`), claimed for one request (`ClaimedEngine`)."""
        slot = self.slots[name or self.default]
        # A new request for a draining model waits for its turn, after the load it drains for.
        if slot.state != "loaded" or slot.engine is None or slot.name in self.draining:
            await self._wait_for_load(slot, timeout_s)
        assert slot.engine is not None
        self.residency.touch(slot.name, self.clock())
        # Claimed with no await since the check or the reservation: it cannot go in between.
        claimed = cast("EngineService", ClaimedEngine(slot.engine, slot))
        if self.residency.budget is not None and self.residency.used > self.residency.budget:
            self._room.trim_soon()  # over since a load whose size was unknown; some may be idle now
        return claimed

    async def _wait_for_load(self, slot: ModelSlot, timeout_s: float | None) -> None:
        """Until the slot's load ends with this waiter's reservation (`ModelSlot.reserved`):
        between a load and its waiters resuming, another load must not take the room back."""
        loop = asyncio.get_running_loop()
        give_up = None if timeout_s is None else loop.time() + timeout_s
        aborted: asyncio.Future[None] = loop.create_future()
        self._waiters.add(aborted)
        slot.waiting += 1
        reserved = False
        load: asyncio.Future[None] | None = None
        try:
            while not reserved:
                left = None if give_up is None else max(0.0, give_up - loop.time())
                load = asyncio.ensure_future(self._loaded(slot, left))
                await asyncio.wait({load, aborted}, return_when=asyncio.FIRST_COMPLETED)
                if aborted.done():  # `abort_all` first, even when the load landed meanwhile
                    aborted.result()
                load.result()
                if slot.engine is not None and slot.reserved > 0:
                    slot.reserved -= 1
                    reserved = True
        finally:
            if load is not None:
                load.cancel()  # this waiter's wait only: the load itself is shielded and goes on
            self._waiters.discard(aborted)
            slot.waiting -= 1
            if not reserved:  # gave up: a reservation made for it must not keep the model
                slot.reserved = min(slot.reserved, slot.waiting)

    async def _loaded(self, slot: ModelSlot, timeout_s: float | None) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._ensure(slot)), timeout_s)
        except TimeoutError:
            raise ModelUnavailableError(
                f"the model {slot.name!r} could not be loaded in time (it waits for memory other "
                "models are using, or it loads slowly); try again"
            ) from None

    def _ensure(self, slot: ModelSlot) -> asyncio.Future[EngineService]:
        """The slot's load, shared by every request waiting for it."""
        if slot.loading is None or slot.loading.done():
            slot.loading = asyncio.create_task(self._load(slot), name=f"diffbatch-load-{slot.name}")
            # A load nobody awaits any more (its request timed out) has logged its failure.
            slot.loading.add_done_callback(lambda task: task.cancelled() or task.exception())
        return slot.loading

    async def _load(self, slot: ModelSlot) -> EngineService:
        if slot.state == "failed" and self.clock() - slot.failed_at < self._retry_failed_s:
            raise self._failed(slot)
        async with self._lock:
            if slot.engine is not None and slot.state == "loaded":
                slot.reserved = slot.waiting
                return slot.engine
            await self._estimate(slot)
            # A parked model coming back leaves its host memory to the one it swaps with.
            await self._room.make_room(slot.name, returning=slot.name if slot.state == "parked" else None)
            if slot.state == "parked" and await self._room.unpark(slot):
                slot.reserved = slot.waiting
                return slot.engine  # type: ignore[return-value]  # unpark: the engine is back
            slot.state = "loading"
            logger.info("loading model %r", slot.name)
            started = self.clock()
            engine = slot.make()
            # The one list: observers added later (metrics, once the server is up) see every model.
            engine.observers = self.observers
            try:
                await engine.start()
            except Exception as exc:
                slot.state, slot.failure = "failed", f"{type(exc).__name__}: {exc}"
                slot.failed_at = self.clock()
                slot.load_failures += 1
                logger.error("model %r failed to load: %s", slot.name, slot.failure)
                raise self._failed(slot) from exc
            for lane in engine.lanes:  # their metrics say which model's worker each is
                lane.model = slot.name
            slot.engine, slot.state, slot.failure = engine, "loaded", None
            slot.reserved = slot.waiting  # each waiter claims it as it resumes
            slot.modality = engine.modality
            slot.loads += 1
            slot.loaded_at = self.clock()
            slot.load_s = slot.loaded_at - started
            footprint = engine.weight_bytes
            self.residency.add(slot.name, footprint, self.clock())
            logger.info(
                "model %r loaded in %.1f s (%.0f MiB of weights; %.0f MiB of models resident)",
                slot.name,
                self.clock() - started,
                footprint / 2**20,
                self.residency.used / 2**20,
            )
            await self._room.trim(slot.name)
            return engine

    async def _estimate(self, slot: ModelSlot) -> None:
        if slot.estimate is None or slot.name in self.residency.known:
            return
        estimate, slot.estimate = slot.estimate, None  # once: its files do not change
        try:
            size = await asyncio.to_thread(estimate)
        except Exception:  # an estimate only: the load measures the size anyway
            logger.warning("cannot estimate the size of model %r before it loads", slot.name, exc_info=True)
            return
        if size:
            self.residency.known[slot.name] = size
            logger.info("model %r: about %.0f MiB of weights, read from its files", slot.name, size / 2**20)

    @staticmethod
    def _failed(slot: ModelSlot) -> ModelUnavailableError:
        return ModelUnavailableError(f"the model {slot.name!r} failed to load: {slot.failure}", retry=False)

    def _default_engine(self) -> EngineService:
        slot = self.slots[self.default]
        engine = slot.engine
        if engine is None or slot.state != "loaded":  # a parked engine's weights are on the host
            raise EngineNotRunningError(f"the model {self.default!r} is not loaded")
        return engine

    @property
    def draining(self) -> set[str]:
        """Busy models a waiting load will unload once idle: their new requests wait their turn."""
        return self._room.draining

    @property
    def retired(self) -> RetiredTotals:
        """What the engines of unloaded models counted."""
        return self._totals.retired

    # What the server asks of its engine as a whole (`EngineService`): the loaded models'
    # engines together (`EngineTotals`), and the default model for callers that name none.

    @property
    def modality(self) -> str:
        return "unknown"  # each model's own, once loaded

    @property
    def unavailable(self) -> str | None:
        return None

    @property
    def workers_up(self) -> int:
        return self._totals.workers_up

    @property
    def lanes(self) -> list[Lane]:
        return self._totals.lanes

    def worker_health(self) -> WorkerHealth:
        return worker_health(self._totals.lanes)

    @property
    def num_waiting(self) -> int:
        return self._totals.num_waiting

    @property
    def num_running(self) -> int:
        return self._totals.num_running

    @property
    def num_unfinished(self) -> int:
        return self._totals.num_unfinished

    @property
    def input_bytes(self) -> int:
        return self._totals.input_bytes

    @property
    def weight_bytes(self) -> int:
        return self.residency.used  # the loaded models' (parked ones are on the host)

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return self._totals.image_caps

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        return self._totals.out_of_memory_in_halves

    @property
    def answers_by_replica(self) -> dict[str, int]:
        return self._totals.answers_by_replica

    @property
    def prompt_cache(self) -> dict[str, float]:
        return self._totals.prompt_cache

    def model_set_status(self) -> ModelSetStatus:
        residency = self.residency
        return ModelSetStatus(
            {name: slot.status() for name, slot in self.slots.items()},
            resident_bytes=residency.used,
            budget_bytes=residency.budget,
            parked_bytes=residency.host_used,
            host_budget_bytes=residency.host_budget,
        )

    def lane_counts(self) -> dict[str, tuple[float, int]]:
        """Busy seconds and units of work by lane label, the unloaded models' lanes too."""
        return self._totals.lane_counts()

    def worker_counts(self) -> Counter[str]:
        return self._totals.worker_counts()

    def step_counter(self, name: str) -> int:
        """One of the step schedulers' STEP_COUNTERS, the unloaded models' counts too."""
        return self._totals.step_counter(name)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """The default model's (routes pick a model's engine with `engine_for`)."""
        return self._default_engine().submit(request)

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        return await self._default_engine().generate(request)

    async def prepare_inputs(self, request: GenerationRequest) -> GenerationRequest:
        return await self._default_engine().prepare_inputs(request)
