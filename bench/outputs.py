"""What a `diffbatch bench` run leaves: a markdown table per workload level on stdout (with
ratios, notes and service-level tables), a PNG plot per workload, and results.json."""

from __future__ import annotations

import json
from pathlib import Path

from bench.per_model import per_model
from bench.quality_pass import QualityResult, quality_json, quality_section
from bench.report import (
    WorkloadResult,
    lone_breakdown,
    markdown_table,
    notes,
    plot,
    preview_split,
    ratio_table,
    to_json,
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
            extra = lone_breakdown(level) if workload.kind == "lone" else []
            for line in [*notes(level), *preview_split(level), *per_model(level), *extra]:
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
