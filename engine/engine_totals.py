"""`EngineTotals`: what the server asks of its engine as a whole (`EngineService`), for a
server of several models (`engine.model_set.ModelSet`): the loaded models' engines together.
A request goes to one model's engine, through `ModelSet.engine_for`; these are the rest:
health, queue gauges, lanes, counts for /metrics, and the default model for callers that
name none."""

from __future__ import annotations

from collections import Counter

from engine.handle import RequestHandle
from engine.lanes import Lane
from engine.request import BatchKey, GenerationRequest, RequestOutput
from engine.service import EngineService


class EngineTotals:
    """Mixed into `ModelSet`, which provides `_engines` and `_default_engine`."""

    def _engines(self) -> list[EngineService]:
        raise NotImplementedError

    def _default_engine(self) -> EngineService:
        raise NotImplementedError

    @property
    def modality(self) -> str:
        return "unknown"  # each model's own, once loaded

    @property
    def unavailable(self) -> str | None:
        return None

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

    @property
    def prompt_cache(self) -> dict[str, float]:
        counts: Counter[str] = Counter()
        for engine in self._engines():
            counts.update(engine.prompt_cache)
        return dict(counts)

    def abort_all(self, error: Exception) -> int:
        return sum(engine.abort_all(error) for engine in self._engines())

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """The default model's (routes pick a model's engine with `engine_for`)."""
        return self._default_engine().submit(request)

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        return await self._default_engine().generate(request)

    async def prepare_inputs(self, request: GenerationRequest) -> GenerationRequest:
        return await self._default_engine().prepare_inputs(request)
