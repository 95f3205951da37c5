"""`EngineService`: what the HTTP server needs of an engine, whether it runs here
(`AsyncEngine`) or behind Ray Serve replicas (`server.ray_serve.remote_engine.RemoteEngine`)."""

from __future__ import annotations

from typing import Protocol

from engine.core.handle import RequestHandle
from engine.core.lanes import Lane
from engine.core.stats import EngineObserver
from engine.request import BatchKey, GenerationRequest, RequestOutput
from engine.worker.profile_run import ProfileResult


class EngineService(Protocol):
    observers: list[EngineObserver]
    # Why the engine stopped serving on its own, for /health.
    failure: str | None
    # What the profile run at start found, for /health and /metrics (None: not asked, or
    # the engines are remote: each Ray replica profiles its own device).
    profile: ProfileResult | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Admit now (raising if refused) and hand the request to its owner."""
        ...

    async def generate(self, request: GenerationRequest) -> RequestOutput: ...

    async def prepare_inputs(self, request: GenerationRequest) -> GenerationRequest: ...

    def abort_all(self, error: Exception) -> int: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def modality(self) -> str: ...

    @property
    def unavailable(self) -> str | None:
        """Why no work can run just now, or None."""
        ...

    @property
    def workers_up(self) -> int: ...

    @property
    def lanes(self) -> list[Lane]:
        """The workers in this process (none when the engines are remote)."""
        ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet ended, wherever they are: waiting, running, paused
        for better-priority work or decoding beside the steps (a model holding any is busy)."""
        ...

    @property
    def input_bytes(self) -> int: ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights its models hold here, as measured when they loaded (0: not
        measured, or the engines are remote: each Ray replica holds its own)."""
        ...

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        """Learnt memory caps per batch key (request mode)."""
        ...

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        """Out-of-memory errors retried in halves that lower no cap or budget, by stage
        (`EngineStats.out_of_memory`; none counted when the engines are remote)."""
        ...

    @property
    def prompt_cache(self) -> dict[str, float]:
        """The prompt-embedding cache's counts added up over the workers (hits, misses,
        evictions, encode_seconds, bytes, entries; empty without one, or when the engines
        are remote)."""
        ...

    @property
    def answers_by_replica(self) -> dict[str, int]:
        """Requests each remote engine replica answered (none when the engine is here)."""
        ...
