"""What First-Block Cache buys and costs in step mode, in process (no HTTP): the held-out
shapes prompts (`pipelines.trained.captions`, 64x64 and the model's default steps unless
told) in step groups of `--group` requests, once per threshold (0 = cache off) and round, the
thresholds taking turns group by group so a noisy machine hits them alike. Per threshold:
images/s (prepare, steps and decode), seconds in the denoiser steps, each against cache off
both in total and as the median of the per-group ratios (a group of one setting against the
same group of cache off, run next to it: what a burst of load on a shared machine cannot
swing), steps and blocks skipped per request, adherence per attribute (`bench.quality`) and
PSNR against the cache-off pictures (from the first round; the pictures do not change).

    python -m bench.cache_quality --model shapes-dit --thresholds 0.1,0.25 --rounds 3 --threads 1

On a machine shared with other work use `--threads 1`: two threads that wait for each other
at every operation run 10-50x slower whenever another process holds one of the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench.fidelity import pooled_psnr
from bench.quality import ATTRIBUTES, Accuracy, score
from engine.request import CacheChoice, GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.trained.captions import HELD_OUT_PROMPTS, HELD_OUT_SEEDS


@dataclass
class Tally:
    """One threshold's pictures (first round) and its times, group by group in run order."""

    images: list[np.ndarray] = field(default_factory=list)
    group_wall_s: list[float] = field(default_factory=list)
    group_step_s: list[float] = field(default_factory=list)
    made: int = 0  # images over every round
    steps_skipped: int = 0
    blocks_skipped: int = 0
    accuracy: Accuracy = field(default_factory=Accuracy)


@dataclass(frozen=True)
class Shape:
    """What every request of the run asks for besides its prompt and seed."""

    size: int = 64
    steps: int | None = None  # None: the model's default


def run_group(
    pipeline: Any, prompts: list[tuple[str, int]], threshold: float, shape: Shape, tally: Tally | None
) -> None:
    """One step group of `prompts`, timed into `tally` (its pictures and skips too when the
    tally has none of this group's yet); None: a warm-up, not kept."""
    requests = []
    for prompt, seed in prompts:
        choice = CacheChoice("first-block", threshold) if threshold > 0 else CacheChoice("none")
        params = SamplingParams(
            width=shape.size, height=shape.size, num_inference_steps=shape.steps, seed=seed, cache=choice
        )
        request = GenerationRequest.create(prompt, params)
        requests.append(request.with_params(pipeline.resolve(request)))
    start = time.perf_counter()
    states = pipeline.prepare(requests)
    stepping = time.perf_counter()
    while not all(state.is_done for state in states):
        pipeline.step([state for state in states if not state.is_done])
    step_s = time.perf_counter() - stepping
    outputs = pipeline.finish(states)
    if tally is None:
        return
    tally.group_wall_s.append(time.perf_counter() - start)
    tally.group_step_s.append(step_s)
    tally.made += len(prompts)
    if len(tally.images) >= len(HELD_OUT_PROMPTS):
        return  # a later round: the same pictures again
    for state, output, (prompt, _) in zip(states, outputs, prompts, strict=True):
        tally.images.append(output.images[0])
        tally.accuracy.merge(score(output.images[0], prompt))
        if state.cache is not None:
            tally.steps_skipped += state.cache.steps_skipped
            tally.blocks_skipped += state.cache.blocks_skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="shapes-dit")
    parser.add_argument("--thresholds", default="0.1,0.25", help="comma list; 0 (off) is always run")
    parser.add_argument("--group", type=int, default=8, help="requests per step group")
    parser.add_argument("--rounds", type=int, default=1, help="times each group runs per threshold")
    parser.add_argument("--size", type=int, default=64, help="image width and height")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    thresholds = [0.0, *(float(t) for t in args.thresholds.split(",") if float(t) > 0)]
    shape = Shape(args.size, args.steps)
    pipeline = load_pipeline(PipelineConfig(model=args.model, num_threads=args.threads))
    prompts = list(zip(HELD_OUT_PROMPTS, HELD_OUT_SEEDS, strict=True))
    groups = [prompts[start : start + args.group] for start in range(0, len(prompts), args.group)]
    for threshold in thresholds:  # warm-up at the measured group size, unmeasured
        run_group(pipeline, groups[0], threshold, shape, None)
    print(f"load average at start: {_load()}", file=sys.stderr)
    tallies = {t: Tally() for t in thresholds}
    turn = 0
    for _ in range(args.rounds):
        for group in groups:
            for threshold in thresholds[turn:] + thresholds[:turn]:
                run_group(pipeline, group, threshold, shape, tallies[threshold])
            turn = (turn + 1) % len(thresholds)
    print(f"load average at end: {_load()}", file=sys.stderr)
    print(report(tallies))


def _load() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def _paired(off: list[float], other: list[float]) -> float:
    """The median over groups of off's time ÷ the other's, each group against itself."""
    return statistics.median(a / b for a, b in zip(off, other, strict=True))


def report(tallies: dict[float, Tally]) -> str:
    off = tallies[0.0]
    lines = [
        "| threshold | images/s | ÷off | ÷off, median per group | step s per group (median) | ÷off, "
        "median per group | steps skipped/req | blocks skipped/req | "
        + " | ".join(ATTRIBUTES)
        + " | mean | PSNR dB vs off |",
        "|---|" + "---:|" * (len(ATTRIBUTES) + 9),
    ]
    for threshold, tally in tallies.items():
        rates = tally.accuracy.rates()
        mean = 100 * sum(rates.values()) / len(rates)
        psnr = "ref" if tally is off else f"{pooled_psnr(tally.images, off.images):.2f}"
        wall, off_wall = sum(tally.group_wall_s), sum(off.group_wall_s)
        cells = [
            "off" if threshold == 0 else f"{threshold:g}",
            f"{tally.made / wall:.2f}",
            f"{off_wall / wall:.2f}",
            f"{_paired(off.group_wall_s, tally.group_wall_s):.2f}",
            f"{statistics.median(tally.group_step_s):.2f}",
            f"{_paired(off.group_step_s, tally.group_step_s):.2f}",
            f"{tally.steps_skipped / len(tally.images):.1f}",
            f"{tally.blocks_skipped / len(tally.images):.1f}",
            *(f"{100 * rates[a]:.0f}%" for a in ATTRIBUTES if a in rates),
            f"{mean:.1f}%",
            psnr,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
