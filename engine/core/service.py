"""`EngineService`: what the HTTP server needs of an engine, whether it runs here
(`AsyncEngine`) or behind Ray Serve replicas (`server.ray_serve.remote_engine.RemoteEngine`),
and whether it serves one model or several (`engine.models.model_set.ModelSet`, whose
models' engines are each one of the others). The server calls only this: `engine_for`
routes a request to its model's engine (an engine of one model is its own), and
`model_set_status` says each model's state where there are several (`ModelSetStatus`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.core.handle import RequestHandle
from engine.core.lanes import Lane, WorkerHealth
from engine.core.stats import EngineObserver
from engine.request import BatchKey, GenerationRequest, RequestOutput
from engine.worker.profile_run import ProfileResult

# "parked": taken off the device to make room, its engine up and its weights in host memory.
ModelState = Literal["unloaded", "loading", "loaded", "parked", "failed"]


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One of several served models as `/health`, `/v1/models` and `/metrics` show it: its
    state, what it makes ("unknown" until it has loaded once), why its last load failed,
    and its counts of loads, unloads to make room, failed loads and moves to host memory
    and back."""

    state: ModelState
    modality: str
    failure: str | None
    loads: int
    evictions: int
    load_failures: int
    parks: int
    unparks: int


@dataclass(frozen=True, slots=True)
class ModelSetStatus:
    """Several served models: each one's status by name, and the bytes of weights resident on
    the device and parked in host memory, against their budgets (None: no budget)."""

    models: dict[str, ModelStatus]
    resident_bytes: int
    budget_bytes: int | None
    parked_bytes: int
    host_budget_bytes: int | None


class EngineService(Protocol):
    observers: list[EngineObserver]
    # Why the engine stopped serving on its own, for /health.
    failure: str | None
    # What the profile run at start found, for /health and /metrics (None: not asked, or
    # the engines are remote: each Ray replica profiles its own device).
    profile: ProfileResult | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def engine_for(self, name: str | None, timeout_s: float | None = None) -> EngineService:
        """The engine that serves model `name` (None: the default), loaded first if need be
        (waiting at most `timeout_s`) and claimed for one request. An engine of one model is
        its own, whatever the name (the server checks names against what it serves)."""
        ...

    def model_set_status(self) -> ModelSetStatus | None:
        """Each model's status, where this engine serves several (loaded on first use); None
        where it serves one, whose state is its own (`is_running`, `modality`, `failure`)."""
        ...

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

    def worker_health(self) -> WorkerHealth:
        """Its workers as `/health` says them (none counted when the engines are remote)."""
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

    # Counters for /metrics over the lanes (`engine.core.lane_counts`); with several models,
    # the unloaded models' counts too, so that a counter never goes back.

    def lane_counts(self) -> dict[str, tuple[float, int]]:
        """Busy seconds and units of work by lane label."""
        ...

    def worker_counts(self) -> Counter[str]:
        """The worker processes' counts added up (`WORKER_COUNTERS`; empty for in-process
        workers, or when the engines are remote)."""
        ...

    def step_counter(self, name: str) -> int:
        """One of the step schedulers' `STEP_COUNTERS` so far."""
        ...
