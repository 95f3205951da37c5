"""Turning rounds into figures: the side-by-side markdown table, ratios and notes (the JSON
file and the plots are written by `bench.outputs`).

Throughput is the median over rounds (each round's outputs / its wall time); latency
percentiles pool every request of every round; server figures add the rounds' sums.
Each figure is also given as a ratio to `direct` (the limit) and to `server` (defaults).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.contenders import RoundResult
from bench.drivers import Sample
from bench.server_metrics import ServerFigures
from bench.workload import Workload


@dataclass
class Cell:
    """Every round one contender ran at one workload level."""

    contender: str
    rounds: list[RoundResult] = field(default_factory=list)

    def figures(self) -> dict[str, float | None]:
        ok = [s for r in self.rounds for s in r.samples if s.ok]
        latencies = [s.latency for s in ok]
        ttfbs = [t for s in ok if (t := s.ttfb) is not None]
        server = sum((r.server for r in self.rounds if r.server is not None), ServerFigures())
        served = any(r.server is not None for r in self.rounds)
        wall = sum(r.wall_s for r in self.rounds)
        return {
            "outputs_per_s": _median_rate(self.rounds, lambda r: sum(s.outputs for s in r.samples if s.ok)),
            "requests_per_s": _median_rate(self.rounds, lambda r: sum(1 for s in r.samples if s.ok)),
            "mean_s": statistics.mean(latencies) if latencies else None,
            "p50_s": percentile(latencies, 50),
            "p90_s": percentile(latencies, 90),
            "p99_s": percentile(latencies, 99),
            "ttfb_p50_s": percentile(ttfbs, 50),
            "mean_batch": server.mean_batch if served else None,
            "max_batch": float(server.batch_max) if served and server.forwards else None,
            # Requests per VAE decode in step mode (stragglers decoded alone show here).
            "mean_decode": server.mean_decode if served else None,
            "queue_wait_s": server.mean_queue_wait_s if served else None,
            "busy": _busy(server, wall) if served and wall > 0 else None,
            "forward_s": server.forward_s / server.forwards if served and server.forwards else None,
            # Denoiser time per request: one forward in request mode, its steps in step mode.
            "forward_per_request_s": server.forward_s / len(ok) if served and ok else None,
            # First-Block Cache (step mode): denoiser blocks each request skipped, on average.
            "cache_blocks_skipped_per_request": (
                server.cache_blocks_skipped / len(ok) if served and ok else None
            ),
            "errors": float(sum(1 for r in self.rounds for s in r.samples if not s.ok)),
            # With a mix of previews: the mean latency of the requests that asked for none
            # and of those that asked for some (what previews cost the others, and them).
            "mean_no_previews_s": _mixed_mean(ok, previews=False),
            "mean_previews_s": _mixed_mean(ok, previews=True),
            # A server of several models: loads, and unloads made to load another.
            "model_loads": float(server.model_loads) if served else None,
            "model_evictions": float(server.model_evictions) if served else None,
        }

    def first_error(self) -> str | None:
        return next((s.error for r in self.rounds for s in r.samples if s.error), None)


@dataclass
class LevelResult:
    label: str
    value: float  # concurrency, burst size, or absolute requests/s
    cells: dict[str, Cell]


@dataclass
class WorkloadResult:
    workload: Workload
    levels: list[LevelResult] = field(default_factory=list)


def _busy(server: ServerFigures, wall_s: float) -> float:
    """Share of the round the executors were running work: everything a worker does
    (prepare, steps and decode in step mode), or, from a server that does not report its
    workers, the denoiser forwards alone."""
    if server.workers:
        return server.worker_busy_s / (wall_s * server.workers)
    return server.forward_s / wall_s


def _mixed_mean(samples: list[Sample], *, previews: bool) -> float | None:
    """Mean latency of the samples with (or without) previews, if the samples mix both."""
    chosen = [s.latency for s in samples if (s.partials > 0) == previews]
    if not chosen or len(chosen) == len(samples):
        return None
    return statistics.mean(chosen)


def _median_rate(rounds: list[RoundResult], count: Any) -> float | None:
    rates = [count(r) / r.wall_s for r in rounds if r.wall_s > 0]
    return statistics.median(rates) if rates else None


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _divide(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _ratio(value: float | None, reference: float | None) -> str:
    return "" if value is None or not reference else f"{value / reference:.2f}"


NONE = "-"  # a figure this contender does not have


def _num(value: float | None, digits: int = 2) -> str:
    return NONE if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return NONE if value is None else f"{value * 1000:.0f}"


def markdown_table(level: LevelResult, unit: str) -> str:
    figures = {name: cell.figures() for name, cell in level.cells.items()}
    direct = figures.get("direct", {}).get("outputs_per_s")
    server = figures.get("server", {}).get("outputs_per_s")
    lines = [
        f"| contender | {unit}/s | req/s | ÷direct | ÷server | p50 ms | p90 ms | p99 ms "
        "| TTFB p50 ms | batch mean | batch max | decode mean | queue wait ms | busy | errors |",
        "|---|" + "---:|" * 14,
    ]
    for name, f in figures.items():
        cells = [
            name,
            _num(f["outputs_per_s"]),
            _num(f["requests_per_s"]),
            _ratio(f["outputs_per_s"], direct),
            _ratio(f["outputs_per_s"], server),
            _ms(f["p50_s"]),
            _ms(f["p90_s"]),
            _ms(f["p99_s"]),
            _ms(f["ttfb_p50_s"]),
            _num(f["mean_batch"]),
            NONE if f["max_batch"] is None else f"{f['max_batch']:.0f}",
            _num(f["mean_decode"]),
            _ms(f["queue_wait_s"]),
            _num(f["busy"]),
            f"{f['errors']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Figures that get a ratio table (throughput and latency; the server-only ones have no direct).
_RATIO_FIGURES = ("outputs_per_s", "requests_per_s", "p50_s", "p90_s", "p99_s", "ttfb_p50_s")


def ratios(level: LevelResult) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each contender's figures divided by direct's and by server's: name -> reference -> figure."""
    figures = {name: cell.figures() for name, cell in level.cells.items()}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, f in figures.items():
        out[name] = {}
        for reference in ("direct", "server"):
            base = figures.get(reference)
            if base is None:
                continue
            out[name][reference] = {key: _divide(f[key], base[key]) for key in _RATIO_FIGURES}
    return out


def ratio_table(level: LevelResult, unit: str) -> str:
    """The same figures as ratios: a contender / direct, and / server (latency below 1 is faster)."""
    table = ratios(level)
    references = [ref for ref in ("direct", "server") if ref in level.cells]
    if not references:
        return ""
    names = {"outputs_per_s": f"{unit}/s", "requests_per_s": "req/s", "p50_s": "p50", "p90_s": "p90"}
    names |= {"p99_s": "p99", "ttfb_p50_s": "TTFB p50"}
    header = [f"{names[key]} ÷{ref}" for ref in references for key in _RATIO_FIGURES]
    lines = ["| contender | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for name, by_reference in table.items():
        cells = [_num(by_reference[ref][key]) for ref in references for key in _RATIO_FIGURES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def round_ratios(level: LevelResult, reference: str = "diffusers") -> list[str]:
    """Each contender's throughput over `reference`'s round by round (a round gives both the
    same trace, one after the other, so the machine's noise hits the pair alike): the median
    ratio and its spread. With `diffusers` in the run it is what the adapter costs."""
    base = level.cells.get(reference)
    if base is None:
        return []
    out = []
    for name, cell in level.cells.items():
        if name == reference:
            continue
        pairs = zip(cell.rounds, base.rounds, strict=False)
        ratios = [_rate(mine) / _rate(theirs) for mine, theirs in pairs if _rate(theirs) > 0]
        if ratios:
            out.append(
                f"{name} ÷ {reference} per round: median {statistics.median(ratios):.3f} "
                f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} rounds)"
            )
    return out


def _rate(result: RoundResult) -> float:
    outputs = sum(s.outputs for s in result.samples if s.ok)
    return outputs / result.wall_s if result.wall_s > 0 else 0.0


def notes(level: LevelResult) -> list[str]:
    """One line per contender that had failures, with the first error, so none pass unseen."""
    out = []
    for name, cell in level.cells.items():
        error = cell.first_error()
        if error:
            out.append(f"{name}: {cell.figures()['errors']:.0f} failed, first: {error}")
    return out


def preview_split(level: LevelResult) -> list[str]:
    """With a mix of requests with and without previews: each contender's mean latency of
    both kinds, so what one request's previews cost the others can be read off."""
    out = []
    for name, cell in level.cells.items():
        f = cell.figures()
        plain, previewing = f["mean_no_previews_s"], f["mean_previews_s"]
        if plain is not None and previewing is not None:
            out.append(
                f"{name}: mean latency {plain * 1000:.1f} ms without previews, "
                f"{previewing * 1000:.1f} ms with"
            )
    return out


def lone_breakdown(level: LevelResult, unit: str = "images") -> list[str]:
    """Where a lone request's time goes in each server (its own metrics), and its cost over direct."""
    encoding = "MP4" if unit == "videos" else "PNG"
    direct = level.cells.get("direct")
    direct_mean = direct.figures()["mean_s"] if direct is not None else None
    out = []
    for name, cell in level.cells.items():
        f = cell.figures()
        mean, queue, forward = f["mean_s"], f["queue_wait_s"], f["forward_per_request_s"]
        if name == "direct" or mean is None or queue is None or forward is None:
            continue
        line = (
            f"{name}: mean latency {mean * 1000:.1f} ms = queue wait {queue * 1000:.1f} + denoiser "
            f"{forward * 1000:.1f} + the rest (encode, decode, HTTP, {encoding}, client) "
            f"{(mean - queue - forward) * 1000:.1f} ms"
        )
        if direct_mean is not None:
            line += f"; {(mean - direct_mean) * 1000:+.1f} ms over a direct one-request call"
        out.append(line)
    return out
