"""A labelled counter's value read from a `Metrics` registry in-process: 0 while no sample has
that label set yet, but only if the registry has the counter at all — a renamed metric fails,
never reads as 0 (as `bench.launch.Server.labelled_count` does over HTTP)."""

from __future__ import annotations

from server.metrics import Metrics


def labelled_count(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    if value is not None:
        return value
    families = {family.name for family in metrics.registry.collect()}
    if name.removesuffix("_total") not in families:
        raise AssertionError(f"the registry has no counter {name!r}")
    return 0.0
