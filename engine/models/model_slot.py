"""`ModelSlot`: one of a `ModelSet`'s served models — how to make its engine, and where it
stands (its state, its counts, the requests waiting for it or holding it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.service import EngineService, ModelState, ModelStatus


@dataclass(slots=True)
class ModelSlot:
    """One served model: how to make its engine, and where it stands."""

    name: str
    make: Callable[[], EngineService]
    preload: bool = False
    # Its weights' bytes read from its files before it first loads (None: unknown), so that
    # the first load makes room ahead; read once, off the event loop.
    estimate: Callable[[], int | None] | None = field(default=None, repr=False)
    engine: EngineService | None = None
    state: ModelState = "unloaded"
    modality: str = "unknown"  # what it makes, known once it has loaded
    failure: str | None = None
    failed_at: float = 0.0
    loads: int = 0
    evictions: int = 0
    claims: int = 0  # engines handed to requests not yet submitted (`ClaimedEngine`)
    waiting: int = 0  # requests waiting for its load
    loaded_at: float = 0.0
    load_s: float = 0.0  # how long its last load took: the least turn it gets once loaded
    reserved: int = 0  # of those, the ones its finished load has kept it for
    load_failures: int = 0
    parks: int = 0  # times it was moved to host memory rather than dropped
    unparks: int = 0  # times it came back from host memory
    loading: asyncio.Task[EngineService] | None = field(default=None, repr=False)

    def status(self) -> ModelStatus:
        return ModelStatus(
            self.state,
            self.modality,
            self.failure,
            self.loads,
            self.evictions,
            self.load_failures,
            self.parks,
            self.unparks,
        )

    @property
    def busy(self) -> bool:
        engine = self.engine
        # Unfinished counts paused requests and decodes beside the steps, which neither
        # waiting nor running does: their states need the weights where they are.
        work = engine is not None and (
            engine.num_waiting > 0 or engine.num_running > 0 or engine.num_unfinished > 0
        )
        return work or self.claims > 0 or self.reserved > 0
