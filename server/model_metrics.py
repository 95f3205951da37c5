"""`/metrics` of a server of several models (read from `EngineService.model_set_status` at
each scrape): each model's state, loads, unloads, failed loads and moves to and from host
memory, and the bytes of weights resident against the budget (and parked in host memory)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.service import EngineService

_STATES = ("unloaded", "loading", "loaded", "parked", "failed")


class ModelSetCollector(Collector):
    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        status = self.engine.model_set_status()
        if status is None:  # one model: nothing of this
            return
        models = status.models.items()
        state = GaugeMetricFamily(
            "diffbatch_model_state",
            "each served model's state (1 for the one it is in)",
            labels=["model", "state"],
        )
        for model, each in models:
            for name in _STATES:
                state.add_metric([model, name], 1.0 if each.state == name else 0.0)
        yield state
        for metric, attribute, text in (
            ("diffbatch_model_loads", "loads", "times each model was loaded"),
            ("diffbatch_model_evictions", "evictions", "times each model was unloaded to make room"),
            ("diffbatch_model_load_failures", "load_failures", "loads of each model that failed"),
            ("diffbatch_model_parks", "parks", "times each model was moved to host memory (not dropped)"),
            ("diffbatch_model_unparks", "unparks", "times each model came back from host memory"),
        ):
            family = CounterMetricFamily(metric, text, labels=["model"])
            for model, each in models:
                family.add_metric([model], getattr(each, attribute))
            yield family
        yield GaugeMetricFamily(
            "diffbatch_models_resident_bytes",
            "bytes of weights of the loaded models",
            value=status.resident_bytes,
        )
        if status.host_budget_bytes is not None:
            yield GaugeMetricFamily(
                "diffbatch_models_parked_bytes",
                "bytes of weights parked in host memory",
                value=status.parked_bytes,
            )
        if status.budget_bytes is not None:
            yield GaugeMetricFamily(
                "diffbatch_models_budget_bytes", "--models-memory-mb in bytes", value=status.budget_bytes
            )
