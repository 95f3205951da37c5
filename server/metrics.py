"""Prometheus metrics: HTTP outcomes from the middleware, batching from the engine.

With several API processes (`--api-server-count`, `server.api_servers`) every process's
counters and histograms are written to files in PROMETHEUS_MULTIPROC_DIR (prometheus-client's
multiprocess mode: the supervisor sets it before any child imports the client), where any
process's scrape adds them up: the API processes' HTTP counts, the engine process's batch
counts, and the counts of processes that died. What is read live at each scrape (queue
gauges, workers, caps, models, the API keys' counts, the result cache: the `live` collectors)
is the engine process's, fetched over IPC as text. In one process both are one registry, as they always were.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core.service import EngineService
from engine.core.stats import QuietObserver
from engine.outputs import DecodeRecord, ForwardRecord, ModerationRecord
from engine.request import RequestBatch
from server.cache_metrics import PromptCacheCollector, ResultCacheCollector
from server.model_metrics import ModelSetCollector
from server.preemption_metrics import PreemptionCollector
from server.result_cache import ResultCache
from server.step_group_metrics import StepGroupCollector

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# One bucket per size up to 16, so a scrape tells the largest batch exactly where it matters.
_SIZES = (*range(1, 17), 24, 32, 48, 64, 128)


# Set by the supervisor of several API processes (`server.api_servers.supervisor`).
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


class Metrics(QuietObserver):
    """All of one app's metrics, in a registry of its own (several apps can share a process).
    `engine_elsewhere`: the engine runs in another process, which binds its own `Metrics`
    and answers its live collectors' text (an API process of several)."""

    def __init__(self, engine_elsewhere: Callable[[], Awaitable[bytes]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._engine_elsewhere = engine_elsewhere
        self._shared_dir = os.environ.get(MULTIPROC_VARIABLE) or None
        # The collectors read at each scrape: beside the instruments in one process; apart
        # from them where the instruments' values are in the shared files.
        self.live = CollectorRegistry() if self._shared_dir else self.registry
        r = self.registry
        self.requests = Counter(
            "diffbatch_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.request_latency = Histogram(
            "diffbatch_request_latency_seconds",
            "HTTP request latency",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "diffbatch_queue_wait_seconds", "time from admission to batch start", buckets=_SECONDS, registry=r
        )
        self.batch_size = Histogram(
            "diffbatch_batch_size", "requests per pipeline forward", buckets=_SIZES, registry=r
        )
        self.step_sizes = Histogram(
            "diffbatch_step_sizes",
            "distinct image sizes (and frame counts) per pipeline forward: above 1, requests of "
            "different sizes shared it",
            buckets=_SIZES,
            registry=r,
        )
        self.batch_images = Histogram(
            "diffbatch_batch_images", "images per pipeline forward", buckets=_SIZES, registry=r
        )
        self.forward_seconds = Histogram(
            "diffbatch_forward_seconds", "duration of one pipeline forward", buckets=_SECONDS, registry=r
        )
        self.decode_size = Histogram(
            "diffbatch_decode_batch_size",
            "requests per VAE decode in step-level batching (requests that finished denoising together)",
            buckets=_SIZES,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "diffbatch_decode_seconds",
            "duration of one step-level VAE decode",
            ["where"],
            buckets=_SECONDS,
            registry=r,
        )
        self.forward_failures = Counter(
            "diffbatch_forward_failures", "pipeline forwards that raised", registry=r
        )
        self.out_of_memory = Counter(
            "diffbatch_out_of_memory", "forwards that ran out of memory (their batch was split)", registry=r
        )
        self.cache_blocks_skipped = Counter(
            "diffbatch_cache_blocks_skipped",
            "denoiser blocks not run under First-Block Cache and TaylorSeer (step mode), over requests",
            registry=r,
        )
        self.recompiles = Counter(
            "diffbatch_denoiser_recompiles",
            "graphs torch.compile compiled during forwards (--compile), after the warm-up at start: "
            "each one a compile the forward's requests waited for",
            registry=r,
        )
        self.forwards_interrupted = Counter(
            "diffbatch_forwards_interrupted",
            "forwards stopped at a denoising step because all their requests were aborted",
            registry=r,
        )
        self.adapter_forwards = Counter(
            "diffbatch_lora_forwards",
            "pipeline forwards (denoiser steps in step-level batching) per LoRA adapter; 'none' = base model",
            ["adapter"],
            registry=r,
        )
        self.webhook_attempts = Counter(
            "diffbatch_webhook_attempts",
            "webhook deliveries tried, by event type and outcome (delivered: a 2xx answer; refused: "
            "another status; error: no answer)",
            ["event", "outcome"],
            registry=r,
        )
        self.webhook_events_dropped = Counter(
            "diffbatch_webhook_events_dropped",
            "webhook events given up on after every attempt failed",
            ["event"],
            registry=r,
        )
        self.moderation_checked = Counter(
            "diffbatch_moderation_checked",
            "requests' images (stage=image: a request's n images count once) and previews "
            "(stage=preview) the safety checker checked (--safety-checker)",
            ["stage"],
            registry=r,
        )
        self.moderation_flagged = Counter(
            "diffbatch_moderation_flagged",
            "of those, flagged: a request failed with content_policy_violation (image), a preview "
            "withheld (preview)",
            ["stage"],
            registry=r,
        )
        for stage in ("image", "preview"):  # shown from the start, at 0
            self.moderation_checked.labels(stage=stage)
            self.moderation_flagged.labels(stage=stage)
        self.aborted = Counter(
            "diffbatch_requests_aborted", "requests aborted (client gone or deadline passed)", registry=r
        )
        self.refused = Counter(
            "diffbatch_requests_refused",
            "requests refused at admission, never queued, by reason (queue_full, deadline_unmeetable)",
            ["reason"],
            registry=r,
        )

    def bind(self, engine: EngineService) -> None:
        """Read `engine` at each scrape and count what it tells its observers (nothing to
        bind where the engine is in another process: that process binds its own)."""
        if self._engine_elsewhere is not None:
            return
        for collector in (
            _Queue(engine),
            _LearntCaps(engine),
            _Workers(engine),
            _ProfileRun(engine),
            PromptCacheCollector(engine),
            PreemptionCollector(engine),
            StepGroupCollector(engine),
        ):
            self.live.register(collector)
        if engine.model_set_status() is not None:  # several models: each one's state too
            self.live.register(ModelSetCollector(engine))
        engine.observers.append(self)

    def watch(self, collector: Collector) -> None:
        """Read `collector` at each scrape (state the server keeps: the API key limits)."""
        self.live.register(collector)

    def watch_result_cache(self, cache: ResultCache) -> None:
        self.watch(ResultCacheCollector(cache))

    async def exposition(self) -> bytes:
        """The text a scrape of /metrics answers: this registry, or with several processes
        every process's counts added up and the engine process's live collectors."""
        if self._shared_dir is None:
            return generate_latest(self.registry)
        shared = CollectorRegistry()
        shared.register(_SharedCounts(self.registry, self._shared_dir))
        engine = b"" if self._engine_elsewhere is None else await self._engine_elsewhere()
        return generate_latest(shared) + generate_latest(self.live) + engine

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        for request in batch.requests:
            self.queue_wait.observe(max(0.0, now - request.arrival_time))

    def on_forward(self, record: ForwardRecord) -> None:
        self.batch_size.observe(record.num_requests)
        self.batch_images.observe(record.num_images)
        self.step_sizes.observe(record.sizes)
        self.forward_seconds.observe(record.seconds)
        self.adapter_forwards.labels(adapter=record.adapter or "none").inc()
        if not record.ok:
            self.forward_failures.inc()
        if record.interrupted:
            self.forwards_interrupted.inc()
        if record.out_of_memory:
            self.out_of_memory.inc()
        self.cache_blocks_skipped.inc(record.cache_blocks_skipped)
        if record.compiles:
            self.recompiles.inc(record.compiles)

    def on_decode(self, record: DecodeRecord) -> None:
        self.decode_size.observe(record.num_requests)
        self.decode_seconds.labels(where="beside" if record.beside else "stepping").observe(record.seconds)

    def on_abort(self, request_id: str) -> None:
        self.aborted.inc()

    def on_moderation(self, record: ModerationRecord) -> None:
        self.moderation_checked.labels(stage=record.stage).inc(record.checked)
        self.moderation_flagged.labels(stage=record.stage).inc(record.flagged)


class _SharedCounts(Collector):
    """Every process's counters and histograms added up (prometheus-client's
    `MultiProcessCollector`), each family as this process's instruments describe it (the
    shared files keep no help text) and present from the start, as in one process: a
    family with no sample in any file yet (a labelled counter before its first label set,
    `diffbatch_lora_forwards` before a forward) is still exported, with its help and type,
    so a scrape says it exists and a dashboard reads it as 0."""

    def __init__(self, instruments: CollectorRegistry, path: str) -> None:
        self._instruments = instruments
        self._path = path

    def collect(self) -> Iterator[Metric]:
        added = multiprocess.MultiProcessCollector(None, path=self._path)  # type: ignore[no-untyped-call]
        families: list[Metric] = list(added.collect())  # type: ignore[no-untyped-call]
        counted = {family.name: family for family in families}
        for family in self._instruments.collect():
            merged = counted.pop(family.name, None)
            if merged is None:
                yield Metric(family.name, family.documentation, family.type)
            else:
                merged.documentation = family.documentation
                yield merged
        yield from counted.values()  # instruments of another kind of process, if any


class _Queue(Collector):
    """The requests waiting and running, and the bytes of input images they hold (read at
    each scrape)."""

    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine = self.engine
        yield GaugeMetricFamily(
            "diffbatch_num_requests_waiting", "requests in the admission queue", value=engine.num_waiting
        )
        yield GaugeMetricFamily(
            "diffbatch_num_requests_running", "requests in the running batch", value=engine.num_running
        )
        yield GaugeMetricFamily(
            "diffbatch_queued_input_bytes",
            "bytes of input images held by requests in progress",
            value=engine.input_bytes,
        )


class _LearntCaps(Collector):
    """`diffbatch_batch_image_cap{key}`: the images a batch of one shape may hold since it ran
    out of memory (read from the scheduler at each scrape; shapes without a cap are absent).
    `diffbatch_step_token_budget{worker}`: in step-level batching, the step tokens each
    worker's running requests may hold, as configured or lower since memory ran out.
    `diffbatch_stage_out_of_memory_total{stage}`: out-of-memory errors retried in halves that
    lower neither (step-level prepare and finish, VAE decodes halved inside the VAE)."""

    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        family = GaugeMetricFamily(
            "diffbatch_batch_image_cap",
            "most images per forward for a batch key that ran out of memory",
            labels=["key"],
        )
        for key, cap in self.engine.image_caps.items():
            family.add_metric([repr(key)], cap)
        yield family
        budget = GaugeMetricFamily(
            "diffbatch_step_token_budget",
            "step level: most step tokens (rows x latent tokens) running at once on a worker, "
            "learnt lower when memory ran out",
            labels=["worker"],
        )
        for lane in self.engine.lanes:
            limit = lane.steps.max_step_cost if lane.steps is not None else None
            if limit is not None:
                budget.add_metric([lane.label], limit)
        yield budget
        halves = CounterMetricFamily(
            "diffbatch_stage_out_of_memory",
            "out-of-memory errors retried in halves that lower no cap or budget: step-level "
            "prepare and finish groups, and VAE decodes halved inside the VAE (both modes)",
            labels=["stage"],
        )
        counts = self.engine.out_of_memory_in_halves
        for stage in ("prepare", "finish", "decode"):
            halves.add_metric([stage], counts.get(stage, 0))
        yield halves


class _Workers(Collector):
    """The engine's workers: how many can run work (a worker process restarting cannot),
    how long each was busy, and for worker processes their restarts and crashes and the
    arrays their results brought through shared memory. In-process (`--executor thread`)
    the one worker is always up."""

    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        lanes = self.engine.lanes
        up = GaugeMetricFamily("diffbatch_workers_up", "pipeline workers able to run work")
        up.add_metric([], self.engine.workers_up)
        yield up
        total = GaugeMetricFamily("diffbatch_workers", "pipeline workers configured (data parallel size)")
        total.add_metric([], len(lanes))
        yield total
        busy = CounterMetricFamily(
            "diffbatch_worker_busy_seconds", "time each worker spent running work", labels=["worker"]
        )
        units = CounterMetricFamily(
            "diffbatch_worker_runs",
            "units of work each worker ran (a batch, or a step iteration)",
            labels=["worker"],
        )
        # A server of several models counts the lanes of unloaded models too (counters never drop).
        for label, (busy_s, runs) in self.engine.lane_counts().items():
            busy.add_metric([label], busy_s)
            units.add_metric([label], runs)
        yield busy
        yield units
        answers = CounterMetricFamily(
            "diffbatch_replica_requests",
            "requests each Ray Serve engine replica answered (a gateway only)",
            labels=["replica"],
        )
        for replica, count in self.engine.answers_by_replica.items():
            answers.add_metric([replica], count)
        yield answers
        workers = self.engine.worker_counts()
        if not workers:  # in-process workers: nothing restarts
            return
        for name, attribute, text in (
            ("diffbatch_worker_restarts", "restarts", "worker processes restarted after dying"),
            ("diffbatch_worker_crashes", "crashes", "worker processes that died"),
            (
                "diffbatch_shm_arrays_received",
                "segments_received",
                "result arrays received through shared memory",
            ),
        ):
            family = CounterMetricFamily(name, text)
            family.add_metric([], workers[attribute])
            yield family


class _ProfileRun(Collector):
    """What the profile run at start found (`engine.worker.profile_run`): its state (1 for the one
    it is in), and when measured the budgets it fitted, the peaks it read and the limit it
    fitted them within. Nothing when no profile run was asked for."""

    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        profile = self.engine.profile
        if profile is None:
            return
        state = GaugeMetricFamily(
            "diffbatch_profile_run",
            "the profile run at start: measured (budgets fitted), unmeasured (ran without a "
            "memory gauge) or skipped",
            labels=["state"],
        )
        for name in ("measured", "unmeasured", "skipped"):
            state.add_metric([name], 1.0 if profile.state == name else 0.0)
        yield state
        for name, value, text in (
            ("diffbatch_profile_max_num_seqs", profile.max_num_seqs, "requests per step group it fitted"),
            ("diffbatch_profile_max_step_tokens", profile.max_step_tokens, "step tokens it fitted"),
            ("diffbatch_profile_decode_budget_pixels", profile.decode_budget, "decode budget it fitted"),
            ("diffbatch_profile_limit_bytes", profile.limit, "device memory x --gpu-memory-utilization"),
        ):
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        peaks = GaugeMetricFamily(
            "diffbatch_profile_peak_bytes",
            "peak device memory of its runs at the fitted budgets",
            labels=["run"],
        )
        for run, peak in (("step", profile.step_peak), ("decode", profile.decode_peak)):
            if peak is not None:
                peaks.add_metric([run], peak)
        yield peaks
