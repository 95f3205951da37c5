"""Reading a round's batching from two scrapes of the server's real metrics page."""

from __future__ import annotations

from prometheus_client import generate_latest

from bench.server_metrics import ServerFigures, figures_between, parse_metrics
from engine.outputs import DecodeRecord, ForwardRecord
from server.metrics import Metrics


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return parse_metrics(generate_latest(metrics.registry).decode())


def test_figures_count_only_what_happened_between_the_scrapes() -> None:
    metrics = Metrics()
    metrics.on_forward(ForwardRecord(num_requests=8, num_images=8, seconds=1.0, ok=True))  # before
    before = scrape(metrics)
    for size, seconds in ((3, 0.5), (5, 0.25), (4, 0.25)):
        metrics.on_forward(ForwardRecord(num_requests=size, num_images=size, seconds=seconds, ok=True))
    metrics.queue_wait.observe(0.2)
    metrics.queue_wait.observe(0.4)
    figures = figures_between(before, scrape(metrics))
    assert figures.forwards == 3
    assert figures.mean_batch == 4.0
    assert figures.batch_max == 5  # exact: one bucket per size up to 16
    assert figures.forward_s == 1.0
    assert figures.mean_queue_wait_s is not None and abs(figures.mean_queue_wait_s - 0.3) < 1e-9
    assert figures.mean_decode is None  # request mode: no decodes of their own


def test_step_modes_decodes_give_the_requests_per_decode() -> None:
    metrics = Metrics()
    metrics.on_decode(DecodeRecord(num_requests=8, num_images=8, seconds=0.1, ok=True))  # before
    before = scrape(metrics)
    metrics.on_decode(DecodeRecord(num_requests=7, num_images=7, seconds=0.1, ok=True))
    metrics.on_decode(DecodeRecord(num_requests=1, num_images=2, seconds=0.02, ok=True, beside=True))
    figures = figures_between(before, scrape(metrics))
    assert (figures.decodes, figures.mean_decode) == (2, 4.0)


def test_an_idle_round_has_no_batches() -> None:
    metrics = Metrics()
    snapshot = scrape(metrics)
    figures = figures_between(snapshot, snapshot)
    assert figures == ServerFigures()
    assert figures.mean_batch is None and figures.mean_queue_wait_s is None


def test_rounds_add_up() -> None:
    total = ServerFigures(2, 6.0, 4, 6, 1.0, 2.0) + ServerFigures(1, 8.0, 8, 8, 3.0, 1.0)
    assert total == ServerFigures(3, 14.0, 8, 14, 4.0, 3.0)
    assert total.mean_batch == 14 / 3


def test_busy_time_is_what_the_workers_report_between_the_scrapes() -> None:
    """Step mode's forwards are single steps: the workers' own busy seconds (prepare and
    decode too) say how busy the server was."""
    page = """# TYPE diffbatch_worker_busy_seconds counter
diffbatch_worker_busy_seconds_total{{worker="0"}} {0}
diffbatch_worker_busy_seconds_total{{worker="1"}} {1}
"""
    before = parse_metrics(page.format(10.0, 4.0))
    after = parse_metrics(page.format(13.0, 5.5))
    figures = figures_between(before, after)
    assert figures.workers == 2
    assert figures.worker_busy_s == 4.5
    assert figures_between(before, before).worker_busy_s == 0.0


def test_model_loads_and_unloads_are_summed_over_the_models() -> None:
    page = """# TYPE diffbatch_model_loads counter
diffbatch_model_loads_total{model="a"} %d
diffbatch_model_loads_total{model="b"} %d
# TYPE diffbatch_model_evictions counter
diffbatch_model_evictions_total{model="a"} %d
diffbatch_model_evictions_total{model="b"} 0
"""
    figures = figures_between(parse_metrics(page % (1, 0, 0)), parse_metrics(page % (3, 2, 3)))
    assert (figures.model_loads, figures.model_evictions) == (4, 3)
