"""Parking an idle model on the host: its engine stays up, its weights move to host memory
and back on its next request — faster than loading it again from disk (docs/benchmarks.md,
"models2"). Only in-process workers can (`ThreadExecutor.move_weights`); a model whose
worker is a process, or remote (Ray), or whose pipeline cannot move its weights
(`pipelines.memory.parking.park_blocker`: offload hooks, quantized weights) is dropped."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.core.service import EngineService

if TYPE_CHECKING:
    from engine.models.model_set import ModelSet
    from engine.models.model_slot import ModelSlot

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


class HostParking:
    """A `ModelSet`'s moves of idle models to host memory and back, under its lock."""

    def __init__(self, models: ModelSet) -> None:
        self._models = models

    async def park(self, slot: ModelSlot) -> None:
        """`slot` (idle, off the device budget, state "parked") to host memory, dropping the
        least recently parked models to make room there; dropped itself if it cannot move."""
        models, engine = self._models, slot.engine
        assert engine is not None
        reason = await park_blocker(engine)
        room = models.residency.host_room(slot.name, models.returning)
        if reason is not None or room is None:
            logger.info("model %r dropped, not parked on the host: %s", slot.name, reason or "no room")
            await models.drop([slot])
            return
        await models.drop([models.slots[name] for name in room])
        started = models.clock()
        try:
            await move_weights(engine, to_host=True)
        except Exception:
            logger.exception("model %r could not move to host memory; dropped", slot.name)
            await models.drop([slot])
            return
        models.residency.park(slot.name, models.clock())
        slot.parks += 1
        logger.info(
            "model %r parked in host memory in %.2f s (%.0f MiB of models parked)",
            slot.name,
            models.clock() - started,
            models.residency.host_used / 2**20,
        )

    async def unpark(self, slot: ModelSlot) -> bool:
        """`slot`'s weights back on the device (room made for them); False when that failed
        (the engine is dropped: the model loads anew)."""
        models, engine = self._models, slot.engine
        assert engine is not None
        started = models.clock()
        try:
            await move_weights(engine, to_host=False)
        except Exception:
            logger.exception("model %r could not come back from host memory; loading it anew", slot.name)
            await models.drop([slot])
            return False
        now = models.clock()
        models.residency.unpark(slot.name, now)
        slot.state, slot.unparks = "loaded", slot.unparks + 1
        slot.loaded_at, slot.load_s = now, now - started
        logger.info("model %r back from host memory in %.2f s", slot.name, slot.load_s)
        return True
