"""`/metrics` of a server of several models (`ModelSet`): each model's state, loads,
unloads, failed loads and moves to and from host memory, and the bytes of weights resident
against the budget (and parked in host memory)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.models.model_set import ModelSet

_STATES = ("unloaded", "loading", "loaded", "parked", "failed")


class ModelSetCollector(Collector):
    def __init__(self, models: ModelSet) -> None:
        self.models = models

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        slots = self.models.slots.values()
        state = GaugeMetricFamily(
            "diffbatch_model_state",
            "each served model's state (1 for the one it is in)",
            labels=["model", "state"],
        )
        for slot in slots:
            for name in _STATES:
                state.add_metric([slot.name, name], 1.0 if slot.state == name else 0.0)
        yield state
        for metric, attribute, text in (
            ("diffbatch_model_loads", "loads", "times each model was loaded"),
            ("diffbatch_model_evictions", "evictions", "times each model was unloaded to make room"),
            ("diffbatch_model_load_failures", "load_failures", "loads of each model that failed"),
            ("diffbatch_model_parks", "parks", "times each model was moved to host memory (not dropped)"),
            ("diffbatch_model_unparks", "unparks", "times each model came back from host memory"),
        ):
            family = CounterMetricFamily(metric, text, labels=["model"])
            for slot in slots:
                family.add_metric([slot.name], getattr(slot, attribute))
            yield family
        residency = self.models.residency
        yield GaugeMetricFamily(
            "diffbatch_models_resident_bytes", "bytes of weights of the loaded models", value=residency.used
        )
        if residency.host_budget is not None:
            yield GaugeMetricFamily(
                "diffbatch_models_parked_bytes",
                "bytes of weights parked in host memory",
                value=residency.host_used,
            )
        if residency.budget is not None:
            yield GaugeMetricFamily(
                "diffbatch_models_budget_bytes", "--models-memory-mb in bytes", value=residency.budget
            )
