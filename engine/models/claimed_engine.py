"""`ClaimedEngine`: one model's engine as `ModelSet.engine_for` hands it to one request.

Between choosing a model's engine and submitting to it, a route may still await (reading
uploads, preparing inputs); the request is then in no engine's queue, yet unloading the
model under it would fail it. So the hand-out is a claim: the model counts as busy until
the request is submitted, or until the route drops the engine without submitting (a
refusal, a client gone: the claim is released when the object is collected).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from engine.core.handle import RequestHandle
from engine.request import GenerationRequest, RequestOutput

if TYPE_CHECKING:
    from engine.core.service import EngineService
    from engine.models.model_slot import ModelSlot


def _release(slot: ModelSlot) -> None:
    slot.claims -= 1


class ClaimedEngine:
    """Everything of the model's engine, with `submit` releasing the claim."""

    def __init__(self, engine: EngineService, slot: ModelSlot) -> None:
        self._engine = engine
        slot.claims += 1
        self._release = weakref.finalize(self, _release, slot)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        try:
            return self._engine.submit(request)
        finally:
            self._release()  # queued now (busy by its own count), or refused

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        return await self.submit(request).result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
