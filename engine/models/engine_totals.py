"""`EngineTotals`: what the server asks of its engine as a whole (`EngineService`), for a
server of several models (`engine.models.model_set.ModelSet`, which holds one): the loaded
models' engines together. A request goes to one model's engine, through
`ModelSet.engine_for`; these are the rest: health, queue gauges, lanes, counts for /metrics.

Counters must not go backwards when a model unloads (Prometheus reads a drop as a reset,
and the next engine of that model counts from zero again): `RetiredTotals` keeps what the
unloaded engines counted, and every counter here adds it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.lane_counts import STEP_COUNTERS, lane_counts, step_counter, worker_counts
from engine.core.lanes import Lane
from engine.core.service import EngineService
from engine.models.model_slot import ModelSlot
from engine.request import BatchKey

# The prompt cache's counts that are counters (its `bytes` and `entries` are its size now).
PROMPT_CACHE_COUNTERS = ("hits", "misses", "evictions", "encode_seconds")


@dataclass(slots=True)
class RetiredTotals:
    """What the engines of unloaded models counted, kept for the counters of the whole."""

    out_of_memory: Counter[str] = field(default_factory=Counter)
    prompt_cache: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    workers: Counter[str] = field(default_factory=Counter)
    lanes: dict[str, tuple[float, int]] = field(default_factory=dict)
    steps: Counter[str] = field(default_factory=Counter)  # the step schedulers' STEP_COUNTERS

    def add(self, engine: EngineService) -> None:
        """Keep `engine`'s counts (it is being unloaded, or stopped)."""
        self.out_of_memory.update(engine.out_of_memory_in_halves)
        cache = engine.prompt_cache
        self.prompt_cache.update({name: cache[name] for name in PROMPT_CACHE_COUNTERS if name in cache})
        self.answers.update(engine.answers_by_replica)
        self.workers.update(worker_counts(engine.lanes))
        self.steps.update({name: step_counter(engine.lanes, name) for name in STEP_COUNTERS})
        for label, (busy_s, units) in lane_counts(engine.lanes).items():
            kept_s, kept_units = self.lanes.get(label, (0.0, 0))
            self.lanes[label] = (kept_s + busy_s, kept_units + units)


class SharedReplicas(Protocol):
    """Engine replicas every model's engine shares (Ray Serve's model multiplexing): counted
    once for the whole, not once per model."""

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...


class EngineTotals:
    """The engines of `slots` that are loaded, together, and what `retired` kept of those
    unloaded; `shared_replicas` when every model's engine shares Ray Serve's replicas."""

    def __init__(
        self, slots: dict[str, ModelSlot], retired: RetiredTotals, shared_replicas: SharedReplicas | None
    ) -> None:
        self._slots = slots
        self.retired = retired
        self.shared_replicas = shared_replicas

    def engines(self) -> list[EngineService]:
        """The loaded models' engines (a parked one's too: its counts go on)."""
        return [slot.engine for slot in self._slots.values() if slot.engine is not None]

    @property
    def workers_up(self) -> int:
        if self.shared_replicas is not None:
            return self.shared_replicas.running
        return sum(engine.workers_up for engine in self.engines())

    @property
    def lanes(self) -> list[Lane]:
        return [lane for engine in self.engines() for lane in engine.lanes]

    @property
    def num_waiting(self) -> int:
        if self.shared_replicas is not None:  # each replica's stats hold all its models'
            return self.shared_replicas.waiting
        return sum(engine.num_waiting for engine in self.engines())

    @property
    def num_running(self) -> int:
        return sum(engine.num_running for engine in self.engines())

    @property
    def num_unfinished(self) -> int:
        return sum(engine.num_unfinished for engine in self.engines())

    @property
    def input_bytes(self) -> int:
        return sum(engine.input_bytes for engine in self.engines())

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return {key: cap for engine in self.engines() for key, cap in engine.image_caps.items()}

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        counts: Counter[str] = Counter(self.retired.out_of_memory)
        for engine in self.engines():
            counts.update(engine.out_of_memory_in_halves)
        return dict(counts)

    @property
    def answers_by_replica(self) -> dict[str, int]:
        counts: Counter[str] = Counter(self.retired.answers)
        for engine in self.engines():
            counts.update(engine.answers_by_replica)
        return dict(counts)

    @property
    def prompt_cache(self) -> dict[str, float]:
        counts: Counter[str] = Counter(self.retired.prompt_cache)
        for engine in self.engines():
            counts.update(engine.prompt_cache)
        return dict(counts)

    def lane_counts(self) -> dict[str, tuple[float, int]]:
        """Busy seconds and units of work by lane label, the unloaded models' lanes too."""
        counts = dict(self.retired.lanes)
        for label, (busy_s, units) in lane_counts(self.lanes).items():
            kept_s, kept_units = counts.get(label, (0.0, 0))
            counts[label] = (kept_s + busy_s, kept_units + units)
        return counts

    def worker_counts(self) -> Counter[str]:
        counts = Counter(self.retired.workers)  # `update`, not `+`: a count of 0 is still shown
        counts.update(worker_counts(self.lanes))
        return counts

    def abort_all(self, error: Exception) -> int:
        return sum(engine.abort_all(error) for engine in self.engines())

    def step_counter(self, name: str) -> int:
        """One of STEP_COUNTERS: the loaded engines' and the unloaded ones' (so the counter
        never goes back)."""
        return step_counter(self.lanes, name) + self.retired.steps[name]
