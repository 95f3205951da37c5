"""Counters of a server of several models never go backwards when a model unloads: the
retired engines' totals are kept and added to the loaded ones' (Prometheus reads a counter
that drops as a reset). Fake engines, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest

from engine.executor.worker_process import WorkerStats
from engine.models.model_set import ModelSet
from server.metrics import Metrics
from tests.engine.models.test_model_set import FakeEngine, MiB, Models, engine_of, run


@dataclass
class FakeExecutor:
    stats: WorkerStats = field(default_factory=WorkerStats)


@dataclass
class FakeSteps:
    num_paused: int = 0
    preemptions: int = 0
    held_back_row_steps: int = 0
    max_step_cost: int | None = None


@dataclass
class FakeLane:
    label: str
    executor: FakeExecutor = field(default_factory=FakeExecutor)
    busy_s: float = 0.0
    units: int = 0
    steps: FakeSteps = field(default_factory=FakeSteps)


class CountingEngine(FakeEngine):
    """A fake engine with the counters /metrics reads: they begin at zero in every new engine."""

    def __init__(self, name: str, weight_bytes: int, fail: str | None = None) -> None:
        super().__init__(name, weight_bytes, fail)
        self.out_of_memory_in_halves = {"decode": 0}
        self.prompt_cache = {"hits": 0.0, "misses": 0.0, "bytes": 0.0}
        self.lanes = [FakeLane(f"{name}/0")]
        self.workers_up = 1
        self.image_caps: dict[Any, int] = {}
        self.input_bytes = 0

    def work(self) -> None:
        self.out_of_memory_in_halves["decode"] += 1
        self.prompt_cache["hits"] += 2
        self.prompt_cache["bytes"] = 100.0  # a gauge: its size now, gone with the engine
        self.lanes[0].busy_s += 1.5
        self.lanes[0].units += 3
        self.lanes[0].executor.stats.restarts += 1
        self.lanes[0].steps.preemptions += 1
        self.lanes[0].steps.held_back_row_steps += 2
        self.answers_by_replica["r1"] = self.answers_by_replica.get("r1", 0) + 1


class CountingModels(Models):
    def _maker(self, name: str) -> Any:
        def make() -> CountingEngine:
            engine = CountingEngine(name, self.sizes[name], self.fail.get(name))
            self.made.append(engine)
            return engine

        return make


def scraped(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_counters_keep_the_unloaded_engines_totals() -> None:
    async def scenario() -> None:
        models = CountingModels({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        metrics = Metrics()
        metrics.bind(group)
        a = await engine_of(group, "a")
        assert isinstance(a, CountingEngine)
        a.work()
        await engine_of(group, "b")  # a unloaded to make room
        assert group.slots["a"].state == "unloaded"
        assert group.out_of_memory_in_halves["decode"] == 1
        assert group.prompt_cache["hits"] == 2 and group.prompt_cache.get("bytes", 0.0) == 0.0
        assert group.answers_by_replica == {"r1": 1}
        text = scraped(metrics)
        assert 'diffbatch_stage_out_of_memory_total{stage="decode"} 1.0' in text
        assert "diffbatch_prompt_cache_hits_total 2.0" in text
        assert 'diffbatch_worker_busy_seconds_total{worker="a/0"} 1.5' in text
        assert 'diffbatch_worker_runs_total{worker="a/0"} 3.0' in text
        assert "diffbatch_worker_restarts_total 1.0" in text
        assert "diffbatch_preemptions_total 1.0" in text
        assert "diffbatch_held_back_row_steps_total 2.0" in text
        again = await engine_of(group, "a")  # back, in a fresh engine counting from zero
        assert isinstance(again, CountingEngine) and again is not a
        again.work()
        text = scraped(metrics)
        assert 'diffbatch_stage_out_of_memory_total{stage="decode"} 2.0' in text
        assert 'diffbatch_worker_busy_seconds_total{worker="a/0"} 3.0' in text
        assert "diffbatch_worker_restarts_total 2.0" in text
        assert "diffbatch_preemptions_total 2.0" in text
        assert "diffbatch_held_back_row_steps_total 4.0" in text
        assert group.answers_by_replica == {"r1": 2}

    run(scenario())
