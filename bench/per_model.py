"""With a mix of models (`model=a,b`): each contender's figures per model, and the loads and
unloads its server made (what swapping models cost)."""

from __future__ import annotations

from bench.report import LevelResult, percentile


def per_model(level: LevelResult) -> list[str]:
    out = []
    for name, cell in level.cells.items():
        ok = [s for r in cell.rounds for s in r.samples if s.ok]
        models = sorted({s.model for s in ok if s.model is not None})
        if not models:
            continue
        parts = []
        for model in models:
            latencies = [s.latency for s in ok if s.model == model]
            p50, p90 = percentile(latencies, 50), percentile(latencies, 90)
            parts.append(f"{model}: {len(latencies)} requests, p50 {_ms(p50)} ms, p90 {_ms(p90)} ms")
        figures = cell.figures()
        loads, evictions = figures["model_loads"], figures["model_evictions"]
        swaps = "" if loads is None else f"; {loads:.0f} model loads, {evictions or 0:.0f} unloads"
        out.append(f"{name}: " + "; ".join(parts) + swaps)
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"
