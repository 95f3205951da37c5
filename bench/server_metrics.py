"""What a server says about its own batching, read from its `/metrics` before and after a round.

The difference of two scrapes gives the round's batches (mean and max size), queue wait
and how long the executors were busy, whoever else used the server before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Snapshot:
    """Every sample of a Prometheus text page, keyed by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@dataclass(frozen=True, slots=True)
class ServerFigures:
    """A round as the server saw it (sums, so rounds add up)."""

    forwards: int = 0
    batch_requests: float = 0.0  # sum of requests over forwards
    batch_max: int = 0  # upper bound: the smallest histogram bucket holding every forward
    queue_waits: int = 0
    queue_wait_s: float = 0.0
    forward_s: float = 0.0
    # Time the executors spent running work (prepare and decode too, in step mode), summed
    # over `workers` of them; 0 workers when the server does not say.
    worker_busy_s: float = 0.0
    workers: int = 0
    # Step mode's VAE decodes and the requests they carried (request mode decodes inside
    # its forwards: none).
    decodes: int = 0
    decode_requests: float = 0.0
    # A server of several models: loads and unloads to make room (summed over its models).
    model_loads: int = 0
    model_evictions: int = 0
    # Denoiser blocks skipped under First-Block Cache (step mode), over all requests.
    cache_blocks_skipped: float = 0.0
    # Preemption at step boundaries (issue 30): requests paused for better-priority work,
    # and the most paused at once of the scrapes; None where the server has no such metrics.
    preemptions: int | None = None
    paused_max: float | None = None

    def __add__(self, other: ServerFigures) -> ServerFigures:
        return ServerFigures(
            self.forwards + other.forwards,
            self.batch_requests + other.batch_requests,
            max(self.batch_max, other.batch_max),
            self.queue_waits + other.queue_waits,
            self.queue_wait_s + other.queue_wait_s,
            self.forward_s + other.forward_s,
            self.worker_busy_s + other.worker_busy_s,
            max(self.workers, other.workers),
            self.decodes + other.decodes,
            self.decode_requests + other.decode_requests,
            self.model_loads + other.model_loads,
            self.model_evictions + other.model_evictions,
            self.cache_blocks_skipped + other.cache_blocks_skipped,
            _add(self.preemptions, other.preemptions),
            _max(self.paused_max, other.paused_max),
        )

    @property
    def mean_batch(self) -> float | None:
        return self.batch_requests / self.forwards if self.forwards else None

    @property
    def mean_decode(self) -> float | None:
        return self.decode_requests / self.decodes if self.decodes else None

    @property
    def mean_queue_wait_s(self) -> float | None:
        return self.queue_wait_s / self.queue_waits if self.queue_waits else None


def figures_between(before: Snapshot, after: Snapshot) -> ServerFigures:
    def delta(name: str) -> float:
        key = (name, ())
        return after.get(key, 0.0) - before.get(key, 0.0)

    def labelled(name: str) -> int:  # a counter summed over its labels (each model's)
        keys = [key for key in after if key[0] == name]
        return round(sum(after[key] - before.get(key, 0.0) for key in keys))

    forwards = round(delta("diffbatch_batch_size_count"))
    busy = [key for key in after if key[0] == "diffbatch_worker_busy_seconds_total"]
    return ServerFigures(
        forwards=forwards,
        batch_requests=delta("diffbatch_batch_size_sum"),
        batch_max=_max_bucket(before, after, "diffbatch_batch_size", forwards),
        queue_waits=round(delta("diffbatch_queue_wait_seconds_count")),
        queue_wait_s=delta("diffbatch_queue_wait_seconds_sum"),
        forward_s=delta("diffbatch_forward_seconds_sum"),
        worker_busy_s=sum(after[key] - before.get(key, 0.0) for key in busy),
        workers=len(busy),
        decodes=round(delta("diffbatch_decode_batch_size_count")),
        decode_requests=delta("diffbatch_decode_batch_size_sum"),
        model_loads=labelled("diffbatch_model_loads_total"),
        model_evictions=labelled("diffbatch_model_evictions_total"),
        cache_blocks_skipped=delta("diffbatch_cache_blocks_skipped_total"),
        preemptions=preemptions_between(before, after),
        paused_max=paused(after),
    )


# Preemption's metrics are matched by what their names say, so that the bench reads them
# whatever their exact names and labels, and a server without them reports none.
def _is_preemption_counter(name: str) -> bool:
    return name.startswith("diffbatch_") and "preempt" in name and name.endswith("_total")


def _is_paused_gauge(name: str) -> bool:
    return name.startswith("diffbatch_") and "paused" in name and not name.endswith(("_total", "_created"))


def preemptions_between(before: Snapshot, after: Snapshot) -> int | None:
    """Preemptions counted between two scrapes (summed over labels), None without the metric."""
    keys = [key for key in after if _is_preemption_counter(key[0])]
    return round(sum(after[key] - before.get(key, 0.0) for key in keys)) if keys else None


def paused(snapshot: Snapshot) -> float | None:
    """Requests paused now (summed over labels), None without the metric."""
    keys = [key for key in snapshot if _is_paused_gauge(key[0])]
    return sum(snapshot[key] for key in keys) if keys else None


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


def _max(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else max(a or 0.0, b or 0.0)


def _max_bucket(before: Snapshot, after: Snapshot, histogram: str, count: int) -> int:
    """The smallest bucket bound below which all of the round's observations fell."""
    if count == 0:
        return 0
    bounds: list[tuple[float, float]] = []
    for (name, labels), value in after.items():
        if name == f"{histogram}_bucket":
            le = float(dict(labels)["le"])
            bounds.append((le, value - before.get((name, labels), 0.0)))
    for le, observed in sorted(bounds):
        if observed >= count and math.isfinite(le):
            return int(le)
    return 0  # beyond the largest finite bucket: unknown
