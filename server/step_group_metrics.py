"""`/metrics` of deadline-aware step groups (`engine.sched.step_groups`), read from each worker's
step scheduler at each scrape. Engines behind Ray Serve replicas count in their replicas."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from engine.core.service import EngineService


class StepGroupCollector(Collector):
    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "diffbatch_held_back_row_steps",
            "step level: steps that a running request of worse priority waited out so that one "
            "with a deadline stayed on track (one per request per step held back)",
            value=self.engine.step_counter("held_back_row_steps"),
        )
