"""Parking an idle model on the host: its engine stays up, its weights move to host memory
and back on its next request — faster than loading it again from disk (docs/benchmarks.md,
"Several models"). Only in-process workers can (`ThreadExecutor.move_weights`); a model whose
worker is a process, or remote (Ray), or whose pipeline cannot move its weights
(`pipelines.memory.parking.park_blocker`: offload hooks, quantized weights) is dropped."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from engine.core.service import EngineService
from engine.models.model_slot import ModelSlot
from engine.models.residency import Residency

logger = logging.getLogger(__name__)


@runtime_checkable
class MovableExecutor(Protocol):
    async def park_blocker(self) -> str | None:
        """Why its pipeline's weights cannot move to the host and back, or None."""
        ...

    async def move_weights(self, to_host: bool) -> None:
        """To host memory, or back where they were; done when this returns."""
        ...


async def park_blocker(engine: EngineService) -> str | None:
    """Why `engine`'s model cannot be parked on the host, or None."""
    lanes = engine.lanes
    if not lanes:
        return "its weights are not in this process"
    for lane in lanes:
        executor = lane.executor
        if not isinstance(executor, MovableExecutor):
            return "a worker process holds its weights"
        reason = await executor.park_blocker()
        if reason is not None:
            return reason
    return None


async def move_weights(engine: EngineService, to_host: bool) -> None:
    for lane in engine.lanes:
        executor = lane.executor
        assert isinstance(executor, MovableExecutor)  # `park_blocker` said None
        await executor.move_weights(to_host)


class Dropping(Protocol):
    async def drop(self, slots: list[ModelSlot]) -> None:
        """Stop the engines of `slots`: their weights go (`ModelRoom.drop`)."""
        ...


class HostParking:
    """A model set's moves of idle models to host memory and back, under its lock: the host
    budget is `residency`'s; a model that cannot move, or has no room there, is dropped by
    `dropping`."""

    def __init__(
        self,
        slots: dict[str, ModelSlot],
        residency: Residency,
        clock: Callable[[], float],
        dropping: Dropping,
    ) -> None:
        self._slots = slots
        self._residency = residency
        self._clock = clock
        self._dropping = dropping

    async def park(self, slot: ModelSlot, returning: str | None) -> None:
        """`slot` (idle, off the device budget, state "parked") to host memory, dropping the
        least recently parked models to make room there (`returning`: a parked model the same
        swap brings back, whose host memory counts as free); dropped itself if it cannot move."""
        engine = slot.engine
        assert engine is not None
        reason = await park_blocker(engine)
        room = self._residency.host_room(slot.name, returning)
        if reason is not None or room is None:
            logger.info("model %r dropped, not parked on the host: %s", slot.name, reason or "no room")
            await self._dropping.drop([slot])
            return
        await self._dropping.drop([self._slots[name] for name in room])
        started = self._clock()
        try:
            await move_weights(engine, to_host=True)
        except Exception:
            logger.exception("model %r could not move to host memory; dropped", slot.name)
            await self._dropping.drop([slot])
            return
        self._residency.park(slot.name, self._clock())
        slot.parks += 1
        logger.info(
            "model %r parked in host memory in %.2f s (%.0f MiB of models parked)",
            slot.name,
            self._clock() - started,
            self._residency.host_used / 2**20,
        )

    async def unpark(self, slot: ModelSlot) -> bool:
        """`slot`'s weights back on the device (room made for them); False when that failed
        (the engine is dropped: the model loads anew)."""
        engine = slot.engine
        assert engine is not None
        started = self._clock()
        try:
            await move_weights(engine, to_host=False)
        except Exception:
            logger.exception("model %r could not come back from host memory; loading it anew", slot.name)
            await self._dropping.drop([slot])
            return False
        now = self._clock()
        self._residency.unpark(slot.name, now)
        slot.state, slot.unparks = "loaded", slot.unparks + 1
        slot.loaded_at, slot.load_s = now, now - started
        logger.info("model %r back from host memory in %.2f s", slot.name, slot.load_s)
        return True
