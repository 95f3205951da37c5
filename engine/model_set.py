"""`ModelSet`: several served models in one server, each with its own engine, loaded on first
use and unloaded by memory.

Every model has its own `AsyncEngine` (scheduler, queue, lanes), so batch keys of two models
never mix; the server routes a request by its `model` through `engine_for`. Which models stay
loaded is `Residency`'s choice under one budget: before a load, the least recently used idle
models are unloaded (dropped: their engines stop, their weights go); a model that runs or
has requests queued is never unloaded, so a load that cannot fit waits for one to go idle,
bounded by the waiting request's deadline. A model whose load fails fails only its own
requests, with the reason, and is tried again no sooner than `retry_failed_s` later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import EngineNotRunningError, ModelUnavailableError
from engine.handle import RequestHandle
from engine.lanes import Lane
from engine.profile_run import ProfileResult
from engine.request import BatchKey, GenerationRequest, RequestOutput
from engine.residency import Residency
from engine.service import EngineService
from engine.stats import EngineObserver

logger = logging.getLogger(__name__)

ModelState = Literal["unloaded", "loading", "loaded", "failed"]

# How often a load that waits for room looks again (the models it waits on finish work in
# their own engines, which do not tell this one).
_ROOM_POLL_S = 0.05


@dataclass(slots=True)
class ModelSlot:
    """One served model: how to make its engine, and where it stands."""

    name: str
    make: Callable[[], EngineService]
    preload: bool = False
    engine: EngineService | None = None
    state: ModelState = "unloaded"
    modality: str = "unknown"  # what it makes, known once it has loaded
    failure: str | None = None
    failed_at: float = 0.0
    loads: int = 0
    evictions: int = 0
    load_failures: int = 0
    loading: asyncio.Task[EngineService] | None = field(default=None, repr=False)

    @property
    def busy(self) -> bool:
        engine = self.engine
        return engine is not None and (engine.num_waiting > 0 or engine.num_running > 0)


class ModelSet:
    """The served models by name; `default` answers requests that name none."""

    def __init__(
        self,
        slots: list[ModelSlot],
        budget_bytes: int | None = None,
        retry_failed_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not slots:
            raise ValueError("a model set needs at least one model")
        self.slots = {slot.name: slot for slot in slots}
        self.default = slots[0].name
        self.residency = Residency(budget_bytes)
        self.observers: list[EngineObserver] = []  # given to every engine it makes
        self.profile: ProfileResult | None = None  # each model's engine profiles its own start
        # A model that fails to load fails its own requests (`/health` names it); the server
        # as a whole serves on.
        self.failure: str | None = None
        self._retry_failed_s = retry_failed_s
        self._clock = clock
        # One load or unload at a time: each decides on the memory the others leave.
        self._lock = asyncio.Lock()
        # Busy models a waiting load will unload once idle: their new requests wait their turn.
        self.draining: set[str] = set()

    async def start(self) -> None:
        """Load the models marked `preload` (a failure is that model's, logged, not raised)."""
        preload = [slot for slot in self.slots.values() if slot.preload]
        await asyncio.gather(*(self._ensure(slot) for slot in preload), return_exceptions=True)

    async def stop(self) -> None:
        for slot in self.slots.values():
            if slot.loading is not None:
                slot.loading.cancel()
        engines = [slot.engine for slot in self.slots.values() if slot.engine is not None]
        await asyncio.gather(*(engine.stop() for engine in engines), return_exceptions=True)
        for slot in self.slots.values():
            slot.engine, slot.state = None, "unloaded"

    def loaded_engines(self) -> list[tuple[str, EngineService]]:
        return [(slot.name, slot.engine) for slot in self.slots.values() if slot.engine is not None]

    async def engine_for(self, name: str | None, timeout_s: float | None = None) -> EngineService:
        """The engine of model `name` (the default for None), loading it first if need be;
        waits at most `timeout_s` for the load."""
        slot = self.slots[name or self.default]
        if slot.state == "loaded" and slot.engine is not None and slot.name not in self.draining:
            self.residency.touch(slot.name, self._clock())
            return slot.engine
        try:
            return await asyncio.wait_for(asyncio.shield(self._ensure(slot)), timeout_s)
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
        if slot.state == "failed" and self._clock() - slot.failed_at < self._retry_failed_s:
            raise self._failed(slot)
        async with self._lock:
            if slot.engine is not None:
                return slot.engine
            await self._make_room(slot.name)
            slot.state = "loading"
            logger.info("loading model %r", slot.name)
            started = self._clock()
            engine = slot.make()
            # The one list: observers added later (metrics, once the server is up) see every model.
            engine.observers = self.observers
            try:
                await engine.start()
            except Exception as exc:
                slot.state, slot.failure = "failed", f"{type(exc).__name__}: {exc}"
                slot.failed_at = self._clock()
                slot.load_failures += 1
                logger.error("model %r failed to load: %s", slot.name, slot.failure)
                raise self._failed(slot) from exc
            slot.engine, slot.state, slot.failure = engine, "loaded", None
            slot.modality = engine.modality
            slot.loads += 1
            footprint = int(getattr(engine, "weight_bytes", 0))
            self.residency.add(slot.name, footprint, self._clock())
            logger.info(
                "model %r loaded in %.1f s (%.0f MiB of weights; %.0f MiB of models resident)",
                slot.name,
                self._clock() - started,
                footprint / 2**20,
                self.residency.used / 2**20,
            )
            await self._trim(slot.name)
            return engine

    @staticmethod
    def _failed(slot: ModelSlot) -> ModelUnavailableError:
        return ModelUnavailableError(f"the model {slot.name!r} failed to load: {slot.failure}", retry=False)

    def _busy(self) -> set[str]:
        return {slot.name for slot in self.slots.values() if slot.busy}

    async def _make_room(self, name: str) -> None:
        """Unload idle models until `name` fits. When only busy ones could make the room, they
        drain: they finish what they hold, take no new requests (those wait for their model's
        turn, after this load), and go once idle — so a model under steady load cannot keep
        another out for ever, and requests for both run in turns."""
        victims = self.residency.evictions(name, self._busy())
        if victims is None:
            victims = self.residency.evictions(name, busy=set()) or []
            self.draining = set(victims)
            logger.info("model %r waits for %s to finish their requests", name, ", ".join(map(repr, victims)))
            try:
                while any(self.slots[victim].busy for victim in victims):
                    await asyncio.sleep(_ROOM_POLL_S)
            finally:
                self.draining = set()
        for victim in victims:
            await self._unload(self.slots[victim], f"to make room for {name!r}")

    async def _trim(self, loaded: str) -> None:
        """After a load whose size was not known before: unload idle models until all fit."""
        victims = self.residency.over_budget(self._busy(), keep=loaded)
        if victims is None:
            logger.warning(
                "models resident (%.0f MiB) exceed the budget: the others are busy; they are "
                "unloaded as they go idle before the next load",
                self.residency.used / 2**20,
            )
            return
        for victim in victims:
            await self._unload(self.slots[victim], f"{loaded!r} is larger than the room made for it")

    async def _unload(self, slot: ModelSlot, why: str) -> None:
        engine = slot.engine
        if engine is None:
            return
        logger.info("unloading model %r (least recently used and idle) %s", slot.name, why)
        slot.engine, slot.state = None, "unloaded"
        self.residency.remove(slot.name)
        slot.evictions += 1
        await engine.stop()

    # What the server asks of its engine as a whole (`EngineService`): the loaded models'
    # engines together. A request goes to one model's engine, through `engine_for`.

    @property
    def is_running(self) -> bool:
        return True

    @property
    def modality(self) -> str:
        return "unknown"  # each model's own, once loaded

    @property
    def unavailable(self) -> str | None:
        return None

    def _engines(self) -> list[EngineService]:
        return [engine for _, engine in self.loaded_engines()]

    @property
    def workers_up(self) -> int:
        return sum(engine.workers_up for engine in self._engines())

    @property
    def lanes(self) -> list[Lane]:
        return [lane for engine in self._engines() for lane in engine.lanes]

    @property
    def num_waiting(self) -> int:
        return sum(engine.num_waiting for engine in self._engines())

    @property
    def num_running(self) -> int:
        return sum(engine.num_running for engine in self._engines())

    @property
    def input_bytes(self) -> int:
        return sum(engine.input_bytes for engine in self._engines())

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return {key: cap for engine in self._engines() for key, cap in engine.image_caps.items()}

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for engine in self._engines():
            counts.update(engine.out_of_memory_in_halves)
        return dict(counts)

    @property
    def answers_by_replica(self) -> dict[str, int]:
        return {}

    def abort_all(self, error: Exception) -> int:
        return sum(engine.abort_all(error) for engine in self._engines())

    def _default_engine(self) -> EngineService:
        engine = self.slots[self.default].engine
        if engine is None:
            raise EngineNotRunningError(f"the model {self.default!r} is not loaded")
        return engine

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """The default model's (routes pick a model's engine with `engine_for`)."""
        return self._default_engine().submit(request)

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        return await self._default_engine().generate(request)

    async def prepare_inputs(self, request: GenerationRequest) -> GenerationRequest:
        return await self._default_engine().prepare_inputs(request)
