"""`/metrics` of preemption in step-level batching (`engine.sched.preemption`), read from each
worker's step scheduler at each scrape: the requests paused now, and how many pauses there
have been. Engines behind Ray Serve replicas count in their replicas, not here."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.service import EngineService


class PreemptionCollector(Collector):
    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        steps = [lane.steps for lane in self.engine.lanes if lane.steps is not None]
        yield GaugeMetricFamily(
            "diffbatch_num_requests_paused",
            "step level: running requests paused for better-priority work or a tenant under its "
            "fair share, their state kept "
            "until they resume (not in the running or waiting gauges)",
            value=sum(s.num_paused for s in steps),
        )
        yield CounterMetricFamily(
            "diffbatch_preemptions",
            "step level: running requests paused for better-priority work or a tenant under its "
            "fair share (each pause counted)",
            value=self.engine.step_counter("preemptions"),
        )
