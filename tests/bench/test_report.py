"""Figures and the table from hand-made samples: medians, percentiles and ratios."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.contenders import RoundResult
from bench.drivers import Sample
from bench.per_model import per_model
from bench.report import (
    Cell,
    LevelResult,
    lone_breakdown,
    markdown_table,
    notes,
    preview_split,
    ratio_table,
    ratios,
)
from bench.server_metrics import ServerFigures


def samples(count: int, latency: float, outputs: int = 1) -> list[Sample]:
    return [
        Sample(i, sent=0.0, done=latency, ok=True, outputs=outputs, first_byte=latency / 2)
        for i in range(count)
    ]


def test_throughput_is_the_median_round_and_latency_pools_every_request() -> None:
    cell = Cell("server")
    for wall in (2.0, 4.0, 8.0):  # 8 images each: 4, 2 and 1 images/s
        cell.rounds.append(
            RoundResult(samples(8, latency=wall / 2), wall, ServerFigures(2, 8.0, 4, 8, 0.8, wall / 2))
        )
    figures = cell.figures()
    assert figures["outputs_per_s"] == 2.0
    assert figures["p50_s"] == 2.0
    assert figures["p99_s"] == pytest.approx(4.0)
    assert figures["ttfb_p50_s"] == 1.0
    assert figures["mean_batch"] == 4.0 and figures["max_batch"] == 4
    assert figures["busy"] == pytest.approx(0.5)  # no workers reported: the forwards
    assert figures["errors"] == 0


def test_busy_is_the_workers_own_time_when_the_server_reports_it() -> None:
    """In step mode a forward is one step; prepare and decode keep the worker busy too."""
    cell = Cell("step")
    figures = ServerFigures(forwards=8, batch_requests=8.0, forward_s=0.5, worker_busy_s=3.0, workers=2)
    cell.rounds.append(RoundResult(samples(8, latency=1.0), 2.0, figures))
    assert cell.figures()["busy"] == pytest.approx(0.75)  # 3 s of 2 workers x 2 s


def test_the_table_gives_ratios_to_direct_and_to_server_and_failures_are_named() -> None:
    direct, server, other = Cell("direct"), Cell("server"), Cell("wait20")
    direct.rounds.append(RoundResult(samples(8, 1.0), 1.0))  # 8 images/s
    server.rounds.append(RoundResult(samples(8, 1.0), 2.0, ServerFigures()))  # 4 images/s
    failed = [*samples(2, 1.0), Sample(2, 0.0, 0.1, ok=False, outputs=0, error="HTTP 500: boom")]
    other.rounds.append(RoundResult(failed, 1.0, ServerFigures()))  # 2 images/s
    level = LevelResult("8", 8, {"direct": direct, "server": server, "wait20": other})
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in markdown_table(level, "images").splitlines()
    }
    assert rows["direct"][1:5] == ["8.00", "8.00", "1.00", "2.00"]
    assert rows["server"][1:5] == ["4.00", "4.00", "0.50", "1.00"]
    assert rows["wait20"][1:5] == ["2.00", "2.00", "0.25", "0.50"]
    assert rows["wait20"][-1].strip(" |") == "1"
    assert notes(level) == ["wait20: 1 failed, first: HTTP 500: boom"]


def test_every_throughput_and_latency_figure_has_ratios_to_direct_and_server() -> None:
    direct, server = Cell("direct"), Cell("server")
    direct.rounds.append(RoundResult([replace(s, first_byte=None) for s in samples(8, 0.5)], 1.0))
    server.rounds.append(RoundResult(samples(8, 2.0), 4.0, ServerFigures()))
    level = LevelResult("8", 8, {"direct": direct, "server": server})
    table = ratios(level)
    assert table["server"]["direct"]["outputs_per_s"] == 0.25
    assert table["server"]["direct"]["p99_s"] == 4.0
    assert table["server"]["direct"]["ttfb_p50_s"] is None  # direct has no first byte
    assert table["direct"]["server"]["p50_s"] == 0.25
    rows = ratio_table(level, "images").splitlines()
    assert rows[0].startswith("| contender | images/s ÷direct | req/s ÷direct | p50 ÷direct")
    assert rows[3].startswith("| server | 0.25 | 0.25 | 4.00 | 4.00 | 4.00 | - | 1.00 |")


def test_a_mix_of_previews_reports_the_mean_latency_of_each_kind() -> None:
    """What previews cost the requests that asked for none is read off a mixed workload."""
    plain = [Sample(i, sent=0.0, done=1.0, ok=True, outputs=1) for i in range(3)]
    previewing = [Sample(3 + i, sent=0.0, done=2.0, ok=True, outputs=4, partials=3) for i in range(2)]
    mixed, alone = Cell("step"), Cell("server")
    mixed.rounds.append(RoundResult([*plain, *previewing], 2.0, ServerFigures()))
    alone.rounds.append(RoundResult(plain, 1.0, ServerFigures()))
    figures = mixed.figures()
    assert figures["mean_no_previews_s"] == 1.0 and figures["mean_previews_s"] == 2.0
    assert alone.figures()["mean_no_previews_s"] is None  # no mix: nothing to split
    level = LevelResult("8", 8, {"step": mixed, "server": alone})
    assert preview_split(level) == ["step: mean latency 1000.0 ms without previews, 2000.0 ms with"]


def test_a_model_mix_reports_each_models_latency_and_the_swaps() -> None:
    cell = Cell("budget")
    mixed = [replace(s, model="a" if s.index % 2 else "b") for s in samples(8, latency=0.5)]
    cell.rounds.append(RoundResult(mixed, 2.0, ServerFigures(model_loads=5, model_evictions=4)))
    (line,) = per_model(LevelResult("4", 4, {"budget": cell}))
    assert line == (
        "budget: a: 4 requests, p50 500 ms, p90 500 ms; b: 4 requests, p50 500 ms, p90 500 ms; "
        "5 model loads, 4 unloads"
    )
    assert per_model(LevelResult("4", 4, {"plain": Cell("plain", [RoundResult(samples(2, 1.0), 1.0)])})) == []


@pytest.mark.parametrize(("unit", "encoding"), [("images", "PNG"), ("videos", "MP4")])
def test_a_lone_request_splits_into_queue_denoiser_and_the_rest(unit: str, encoding: str) -> None:
    """The rest is named by what the server encodes: a PNG per image, an MP4 per video."""
    direct, server = Cell("direct"), Cell("server")
    direct.rounds.append(RoundResult(samples(4, latency=0.1), 0.4))
    figures = ServerFigures(4, 4.0, 1, 4, 0.04, 0.2)  # 10 ms queue wait, 50 ms denoiser each
    server.rounds.append(RoundResult(samples(4, latency=0.12), 0.48, figures))
    (line,) = lone_breakdown(LevelResult("1", 1, {"direct": direct, "server": server}), unit)
    assert line == (
        "server: mean latency 120.0 ms = queue wait 10.0 + denoiser 50.0 + the rest "
        f"(encode, decode, HTTP, {encoding}, client) 60.0 ms; +20.0 ms over a direct one-request call"
    )
