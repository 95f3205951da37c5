"""`diffbatch bench --quality`: what each contender's speed costs in pictures.

Every contender draws the fixed held-out prompts (`HELD_OUT_PROMPTS`, seeds 1000-1031) at
64x64, the size the shapes scorer reads. Each picture is scored against its caption
(`pipelines/trained/quality.py`: accuracy per attribute), and compared with the reference's picture of
the same prompt and seed: PSNR pooled over the set and mean SSIM (`bench/fidelity.py`).
The reference is the model loaded in this process in float32 with no server flags (no
cache, no quantization) at full steps: `--reference-steps`, else the model's default.
Contenders draw at `--quality-steps`, else each at its own default, so a server started
with fewer default steps shows what they cost. Adherence means something on the trained
shapes models only (a tiny-* model draws noise); PSNR/SSIM on any image model.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.contenders import Contender, Pictures
from bench.fidelity import pooled_psnr, ssim
from bench.plan import Plan, load_direct
from bench.report import WorkloadResult
from bench.workload import RequestSpec
from pipelines.trained.captions import HELD_OUT_PROMPTS, HELD_OUT_SEEDS, parse_caption
from pipelines.trained.quality import ATTRIBUTES, Accuracy, Reading, score, score_reading

SIZE = 64
REFERENCE = "reference"
# What a failed request is scored as: nothing drawn, so every attribute it asks for is missed.
_NOTHING = Reading(background="", shapes=())


def held_out_specs(steps: int | None, *, previews: bool = False) -> list[RequestSpec]:
    """One request per held-out prompt with its seed (steps None: the contender's default);
    with `previews`, each asks for one preview, which comes after the middle step."""
    return [
        RequestSpec(
            prompt,
            width=SIZE,
            height=SIZE,
            steps=steps,
            guidance=None,
            n=1,
            seed=seed,
            partial_images=1 if previews else 0,
        )
        for prompt, seed in zip(HELD_OUT_PROMPTS, HELD_OUT_SEEDS, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class QualityResult:
    """One contender's pictures of the held-out prompts, judged."""

    contender: str
    accuracy: Accuracy
    psnr_db: float | None  # against the reference; None where nothing could be compared
    ssim: float | None
    compared: int  # pictures compared with the reference (same size, both drawn)
    failed: int
    error: str | None = None


def judge(name: str, pictures: Pictures, reference: Pictures | None) -> QualityResult:
    accuracy = Accuracy()
    for image, prompt in zip(pictures.images, HELD_OUT_PROMPTS, strict=True):
        accuracy.merge(
            score(image, prompt) if image is not None else score_reading(_NOTHING, parse_caption(prompt))
        )
    pairs = []
    if reference is not None:
        pairs = [
            (image, ref)
            for image, ref in zip(pictures.images, reference.images, strict=True)
            if image is not None and ref is not None and image.shape == ref.shape
        ]
    drawn, refs = [p[0] for p in pairs], [p[1] for p in pairs]
    return QualityResult(
        contender=name,
        accuracy=accuracy,
        psnr_db=pooled_psnr(drawn, refs) if pairs else None,
        ssim=statistics.mean(ssim(a, b) for a, b in pairs) if pairs else None,
        compared=len(pairs),
        failed=sum(image is None for image in pictures.images),
        error=pictures.error,
    )


async def run_quality(
    plan: Plan,
    contenders: list[Contender],
    *,
    steps: int | None,
    reference_steps: int | None,
    out: Path,
    previews: bool = False,
) -> list[QualityResult]:
    """Load the reference (the plan's model in float32, in this process), then measure."""
    reference = await asyncio.to_thread(load_direct, plan, name=REFERENCE, dtype="float32")
    return await measure_quality(
        contenders,
        reference,
        steps=steps,
        reference_steps=reference_steps,
        concurrency=plan.max_num_seqs,
        out=out,
        previews=previews,
    )


async def measure_quality(
    contenders: list[Contender],
    reference: Contender,
    *,
    steps: int | None,
    reference_steps: int | None,
    concurrency: int,
    out: Path,
    previews: bool = False,
) -> list[QualityResult]:
    """The reference's pictures first, then each contender's, judged against them; each
    set is also saved as a grid (`out/quality-NAME.png`) to look at.

    With `previews`, a server contender is judged on its middle-step previews against the
    reference's final pictures (a contender that draws no previews, `direct`, is left
    out). It draws the set once unscored first: a linear preview decoder fits itself on the
    server's final decodes and previews through the VAE until it has seen a few."""
    truth = await reference.pictures(held_out_specs(reference_steps), concurrency)
    save_grid(truth, out / f"quality-{REFERENCE}.png")
    results = [judge(REFERENCE, truth, truth)]
    for contender in contenders:
        if previews:
            if not contender.draws_previews:
                continue
            await contender.pictures(held_out_specs(steps, previews=True), concurrency)
        pictures = await contender.pictures(held_out_specs(steps, previews=previews), concurrency)
        save_grid(pictures, out / f"quality-{contender.name}.png")
        results.append(judge(contender.name, pictures, truth))
    return results


def save_grid(pictures: Pictures, path: Path, columns: int = 8) -> None:
    """The pictures 8 a row in prompt order, a failed one grey; skipped if sizes differ."""
    drawn = [image for image in pictures.images if image is not None]
    if not drawn or any(image.shape != drawn[0].shape for image in drawn):
        return
    blank = np.full_like(drawn[0], 128)
    tiles = [blank if image is None else image for image in pictures.images]
    tiles += [blank] * (-len(tiles) % columns)
    rows = [np.concatenate(tiles[i : i + columns], axis=1) for i in range(0, len(tiles), columns)]
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


def quality_table(results: list[QualityResult], speed: dict[str, dict[str, float | None]]) -> str:
    """Adherence per attribute and closeness to the reference, beside each contender's
    throughput and p50 latency (`speed`: figures by contender, from one workload level)."""
    header = "| contender | images/s | p50 ms | " + " | ".join(ATTRIBUTES) + " | PSNR dB | SSIM | failed |"
    lines = [header, "|---|" + "---:|" * (len(ATTRIBUTES) + 5)]
    for result in results:
        figures = speed.get(result.contender, {})
        rates = result.accuracy.rates()
        p50 = figures.get("p50_s")
        cells = [
            result.contender,
            _fmt(figures.get("outputs_per_s"), "{:.2f}"),
            _fmt(None if p50 is None else 1000 * p50, "{:.0f}"),
            *(_fmt(None if a not in rates else 100 * rates[a], "{:.0f}%") for a in ATTRIBUTES),
            "ref" if result.contender == REFERENCE else _fmt(result.psnr_db, "{:.2f}"),
            "ref" if result.contender == REFERENCE else _fmt(result.ssim, "{:.4f}"),
            str(result.failed),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def quality_json(results: list[QualityResult]) -> dict[str, Any]:
    return {
        result.contender: {
            "rates": result.accuracy.rates(),
            "hits": {a: result.accuracy.hits[a] for a in ATTRIBUTES},
            "totals": {a: result.accuracy.totals[a] for a in ATTRIBUTES},
            # JSON has no infinity: identical pictures (the reference's own) say "inf".
            "psnr_db": "inf" if result.psnr_db == float("inf") else result.psnr_db,
            "ssim": result.ssim,
            "compared": result.compared,
            "failed": result.failed,
            "error": result.error,
        }
        for result in results
    }


def quality_section(results: list[QualityResult], first: WorkloadResult, meta: dict[str, object]) -> str:
    """The report's quality section: what was drawn, how it is judged, and the table beside
    the throughput and p50 of the first workload's first level."""
    level = first.levels[0]
    speed = {name: cell.figures() for name, cell in level.cells.items()}
    steps = meta.get("quality_steps") or "each contender's default"
    reference_steps = meta.get("reference_steps") or "the model's default"
    seeds = f"{HELD_OUT_SEEDS[0]}-{HELD_OUT_SEEDS[-1]}"
    drawn = "Pictures"
    if meta.get("quality_previews"):
        drawn = "Each server's previews after its middle step (partial_images=1, after one unscored pass),"
    lines = [
        f"## quality: {len(HELD_OUT_PROMPTS)} held-out prompts, seeds {seeds}",
        "",
        f"{drawn} {SIZE}x{SIZE} at steps {steps}; the reference: float32 in this process, no server "
        f"flags, at steps {reference_steps}. Adherence: the scorer's accuracy per attribute "
        "(pipelines/trained/quality.py; meaningful on the shapes models); PSNR pooled over the set "
        "and mean SSIM against the reference's pictures of the same seeds. Throughput and p50: workload "
        f"`{first.workload.spec}` at {first.workload.axis()} {level.label}.",
        "",
        quality_table(results, speed),
    ]
    lines += [f"\n> {r.contender}: {r.failed} failed, first: {r.error}" for r in results if r.error]
    return "\n".join(lines) + "\n"
