"""`ModelRoom`: making room on the device for a model about to load (`ModelSet`'s unloading).

`Residency` chooses the victims under the budget; this carries the choice out: idle models
are unloaded (parked in host memory when it has room, `engine.models.host_parking`; else
dropped: their engines stop), busy ones drain once they have had their turn, and after a
load whose size was not known before, the models are trimmed back within the budget.
The model set holds one, and its lock: one load or unload at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from engine.models.engine_totals import RetiredTotals
from engine.models.host_parking import HostParking
from engine.models.model_slot import ModelSlot
from engine.models.residency import Residency

logger = logging.getLogger("engine.models.model_set")

# How often a load that waits for room looks again (the models it waits on finish work in
# their own engines, which do not tell this one).
_ROOM_POLL_S = 0.05


class ModelRoom:
    """Unloads among `slots` as `residency` chooses, keeping the unloaded engines' counts in
    `retired`; `lock` is the model set's (held by the caller of `make_room` and `trim`)."""

    def __init__(
        self,
        slots: dict[str, ModelSlot],
        residency: Residency,
        retired: RetiredTotals,
        clock: Callable[[], float],
        lock: asyncio.Lock,
    ) -> None:
        self._slots = slots
        self._residency = residency
        self._retired = retired
        self._clock = clock
        self._lock = lock
        # Busy models a waiting load will unload once idle: their new requests wait their turn.
        self.draining: set[str] = set()
        # The parked model the load under way brings back (it leaves its host memory to the
        # one it swaps with).
        self._returning: str | None = None
        self._trimming: asyncio.Task[None] | None = None
        self._parking = HostParking(slots, residency, clock, self)

    async def unpark(self, slot: ModelSlot) -> bool:
        """`slot`'s weights back on the device (`HostParking.unpark`)."""
        return await self._parking.unpark(slot)

    def _turn_over(self, slot: ModelSlot) -> bool:
        return self._clock() - slot.loaded_at >= slot.load_s

    def _busy(self) -> set[str]:
        return {slot.name for slot in self._slots.values() if slot.busy}

    async def make_room(self, name: str, returning: str | None = None) -> None:
        """Unload idle models until `name` fits. When only busy ones could make the room, they
        drain once they have had their turn (as long as their load took): they finish what they
        hold, take no new requests (those wait for their model's next turn, after this load),
        and go once idle — so a model under steady load cannot keep another out for ever, and
        requests for both run in turns. `returning`: the parked model this load brings back."""
        self._returning = returning
        try:
            victims = self._residency.evictions(name, self._busy())
            if victims is None:
                victims = self._residency.evictions(name, busy=set()) or []
                # Each keeps its turn at least as long as loading it took, so a swap costs at
                # most half the time, however the requests for the models interleave.
                while any(self._slots[v].busy and not self._turn_over(self._slots[v]) for v in victims):
                    await asyncio.sleep(_ROOM_POLL_S)
                self.draining = set(victims)
                logger.info(
                    "model %r waits for %s to finish their requests", name, ", ".join(map(repr, victims))
                )
                try:
                    while any(self._slots[victim].busy for victim in victims):
                        await asyncio.sleep(_ROOM_POLL_S)
                finally:
                    self.draining = set()
            await self._unload([self._slots[victim] for victim in victims], f"to make room for {name!r}")
        finally:
            self._returning = None

    async def trim(self, loaded: str) -> None:
        """After a load whose size was not known before: unload idle models until all fit
        (or all that are idle, when busy ones alone overflow: the rest go as they idle)."""
        victims = self._residency.over_budget(self._busy(), keep=loaded)
        if victims is None:
            victims = self._residency.over_budget(set(), keep=loaded) or []
            busy = self._busy()
            victims = [victim for victim in victims if victim not in busy]
            logger.warning(
                "models resident (%.0f MiB) exceed the budget: busy models stay until they are idle",
                self._residency.used / 2**20,
            )
        await self._unload(
            [self._slots[victim] for victim in victims], "to bring the models within the budget"
        )

    def trim_soon(self) -> None:
        if self._trimming is None or self._trimming.done():

            async def trim() -> None:
                async with self._lock:
                    await self.trim(loaded="")

            self._trimming = asyncio.create_task(trim(), name="diffbatch-trim-models")

    async def _unload(self, slots: list[ModelSlot], why: str) -> None:
        """Take every victim off the device before the first await (parked, or dropped: a
        request arriving meanwhile must not be handed an engine about to go; it waits for the
        lock and loads or unparks its model), then stop the dropped ones' engines and move
        the parked ones' weights to the host."""
        drop, park = [], []
        for slot in slots:
            if slot.engine is None or slot.busy:  # claimed meanwhile: it stays
                continue
            logger.info("unloading model %r (least recently used and idle) %s", slot.name, why)
            self._residency.remove(slot.name)
            slot.evictions += 1
            if self._residency.host_room(slot.name, self._returning) is not None:
                slot.state = "parked"
                park.append(slot)
            else:
                drop.append(slot)
        await self.drop(drop)
        for slot in park:
            await self._parking.park(slot, self._returning)

    async def drop(self, slots: list[ModelSlot]) -> None:
        """Stop the engines of `slots` (idle, off the device or parked): their weights go."""
        engines = []
        for slot in slots:
            if slot.engine is not None:
                engines.append(slot.engine)
                self._retired.add(slot.engine)
            slot.engine, slot.state = None, "unloaded"
            self._residency.drop_parked(slot.name)
        await asyncio.gather(*(engine.stop() for engine in engines))
