"""What a `diffbatch bench` run leaves: a markdown table per workload level on stdout (with
ratios, notes and service-level tables), a PNG plot per workload, and results.json
(`to_json`)."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.per_model import per_model
from bench.quality_pass import QualityResult, quality_json, quality_section
from bench.report import (
    WorkloadResult,
    lone_breakdown,
    markdown_table,
    notes,
    preview_split,
    ratio_table,
    ratios,
    round_ratios,
)
from bench.slo_report import add_service_levels, slo_tables

OPEN_LOOP_NOTE = (
    "Open loop: a server that keeps up delivers the arrival rate, so compare latency here; "
    "direct runs the same requests back to back and shows the capacity limit."
)


def write_outputs(
    results: list[WorkloadResult],
    meta: dict[str, object],
    out: Path,
    unit: str,
    quality: list[QualityResult] | None = None,
) -> None:
    keys = ("model", "device", "dtype", "threads", "cpu", "gpu", "date")
    header = " ".join(f"{key}={meta[key]}" for key in keys)
    if "alone_times_ms" in meta:
        alone = meta["alone_times_ms"]
        assert isinstance(alone, dict)
        times = "; ".join(f"{shape}: {ms:.0f} ms" for shape, ms in alone.items())
        print(f"Alone times (deadline=Nx is N times these): {times}\n")
    for i, result in enumerate(results):
        workload = result.workload
        print(f"## workload `{workload.spec}` ({workload.mix.describe()})\n")
        if workload.kind == "poisson":
            print(OPEN_LOOP_NOTE + "\n")
        for level in result.levels:
            rate = f" = {level.value:.2f}/s" if level.label.endswith("%") else ""
            print(f"### {workload.axis()} {level.label}{rate}")
            print()
            print(markdown_table(level, unit))
            print()
            print(ratio_table(level, unit))
            extra = lone_breakdown(level, unit) if workload.kind == "lone" else []
            lines = [*round_ratios(level), *notes(level), *preview_split(level), *per_model(level), *extra]
            for line in lines:
                print(f"\n> {line}")
            print()
            for line in slo_tables(level, unit):
                print(line)
            print()
        title = f"{meta['command']}\n{header}\n{workload.spec} ({workload.mix.describe()})"
        plot(result, out / f"{i + 1}-{workload.kind}.png", title, unit)
    document = to_json(meta, results)
    add_service_levels(document, results)
    if quality is not None:
        print(quality_section(quality, results[0], meta))
        document["quality"] = quality_json(quality)
    (out / "results.json").write_text(json.dumps(document, indent=1))
    print(f"results: {out / 'results.json'}; plots: {out}/*.png")


def to_json(meta: dict[str, Any], results: list[WorkloadResult]) -> dict[str, Any]:
    return {
        "meta": meta,
        "workloads": [
            {
                "spec": result.workload.spec,
                "kind": result.workload.kind,
                "mix": result.workload.mix.describe(),
                "levels": [
                    {
                        "label": level.label,
                        "value": level.value,
                        "contenders": {
                            name: {
                                "figures": cell.figures(),
                                "ratios": ratios(level)[name],
                                "rounds": [
                                    {
                                        "wall_s": r.wall_s,
                                        "server": None if r.server is None else asdict(r.server),
                                        "samples": [asdict(s) for s in r.samples],
                                    }
                                    for r in cell.rounds
                                ],
                            }
                            for name, cell in level.cells.items()
                        },
                    }
                    for level in result.levels
                ],
            }
            for result in results
        ],
    }


def plot(result: WorkloadResult, path: Path, title: str, unit: str) -> None:
    """Throughput and p99 latency against the workload's level, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(result.levels[0].cells) if result.levels else []
    for name in names:
        xs = [level.value for level in result.levels]
        figures = [level.cells[name].figures() for level in result.levels]
        style = {"marker": "o", "linestyle": "--" if name == "direct" else "-"}
        left.plot(xs, [_nan(f["outputs_per_s"]) for f in figures], label=name, **style)
        right.plot(xs, [_nan(f["p99_s"]) for f in figures], label=name, **style)
    left.set(xlabel=result.workload.axis(), ylabel=f"{unit}/s", title="throughput")
    right.set(xlabel=result.workload.axis(), ylabel="seconds", title="p99 latency")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.set_ylim(bottom=0)
    left.legend()
    figure.suptitle("\n".join(textwrap.fill(line, 140) for line in title.splitlines()), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
