"""What a cache mode buys and costs in step mode, in process (no HTTP): the held-out
shapes prompts (`pipelines.trained.captions`, 64x64 and the model's default steps unless
told) in step groups of `--group` requests, once per setting (and with the cache off) and
round, the settings taking turns group by group so a noisy machine hits them alike. First-
Block Cache's settings are thresholds; TaylorSeer's are INTERVAL/WARMUP/ORDER. Per setting:
images/s (prepare, steps and decode), seconds in the denoiser steps, each against cache off
both in total and as the median of the per-group ratios (a group of one setting against the
same group of cache off, run next to it: what a burst of load on a shared machine cannot
swing), steps and blocks skipped per request, adherence per attribute (`pipelines.trained.quality`) and
PSNR against the cache-off pictures (from the first round; the pictures do not change).

    python -m bench.cache_quality --model shapes-dit --thresholds 0.1,0.25 --rounds 3 --threads 1
    python -m bench.cache_quality --model shapes-dit --mode taylorseer --settings 2/2/1,3/2/1

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
from engine.request import CacheChoice, GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.trained.captions import HELD_OUT_PROMPTS, HELD_OUT_SEEDS
from pipelines.trained.quality import ATTRIBUTES, Accuracy, score


@dataclass
class Tally:
    """One setting's pictures (first round) and its times, group by group in run order."""

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
    pipeline: Any, prompts: list[tuple[str, int]], choice: CacheChoice, shape: Shape, tally: Tally | None
) -> None:
    """One step group of `prompts`, timed into `tally` (its pictures and skips too when the
    tally has none of this group's yet); None: a warm-up, not kept."""
    requests = []
    for prompt, seed in prompts:
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
        for cache in (state.cache, state.taylor_seer):
            if cache is not None:
                tally.steps_skipped += cache.steps_skipped
                tally.blocks_skipped += cache.blocks_skipped


def choices_of(mode: str, settings: str) -> dict[str, CacheChoice]:
    """Each setting's choice by its label, the cache off first."""
    choices = {"off": CacheChoice("none")}
    for setting in settings.split(","):
        if mode == "taylorseer":
            interval, warmup, order = (int(part) for part in setting.split("/"))
            choice = CacheChoice("taylorseer", interval=interval, warmup=warmup, order=order)
        else:
            choice = CacheChoice("first-block", float(setting))
        if choice.on:
            choices[setting] = choice
    return choices


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="shapes-dit")
    parser.add_argument("--mode", choices=["first-block", "taylorseer"], default="first-block")
    parser.add_argument("--thresholds", default="0.1,0.25", help="first-block: comma list; off is always run")
    parser.add_argument(
        "--settings", default="2/2/1,3/2/1", help="taylorseer: comma list of INTERVAL/WARMUP/ORDER"
    )
    parser.add_argument("--group", type=int, default=8, help="requests per step group")
    parser.add_argument("--rounds", type=int, default=1, help="times each group runs per threshold")
    parser.add_argument("--size", type=int, default=64, help="image width and height")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    choices = choices_of(args.mode, args.settings if args.mode == "taylorseer" else args.thresholds)
    labels = list(choices)
    shape = Shape(args.size, args.steps)
    pipeline = load_pipeline(PipelineConfig(model=args.model, num_threads=args.threads))
    prompts = list(zip(HELD_OUT_PROMPTS, HELD_OUT_SEEDS, strict=True))
    groups = [prompts[start : start + args.group] for start in range(0, len(prompts), args.group)]
    for label in labels:  # warm-up at the measured group size, unmeasured
        run_group(pipeline, groups[0], choices[label], shape, None)
    print(f"load average at start: {_load()}", file=sys.stderr)
    tallies = {label: Tally() for label in labels}
    turn = 0
    for _ in range(args.rounds):
        for group in groups:
            for label in labels[turn:] + labels[:turn]:
                run_group(pipeline, group, choices[label], shape, tallies[label])
            turn = (turn + 1) % len(labels)
    print(f"load average at end: {_load()}", file=sys.stderr)
    print(report(tallies, "interval/warmup/order" if args.mode == "taylorseer" else "threshold"))


def _load() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def _paired(off: list[float], other: list[float]) -> float:
    """The median over groups of off's time ÷ the other's, each group against itself."""
    return statistics.median(a / b for a, b in zip(off, other, strict=True))


def report(tallies: dict[str, Tally], setting: str = "threshold") -> str:
    """The table: `tallies` by label, the cache off's ("off") first."""
    off = tallies["off"]
    lines = [
        f"| {setting} | images/s | ÷off | ÷off, median per group | step s per group (median) | ÷off, "
        "median per group | steps skipped/req | blocks skipped/req | "
        + " | ".join(ATTRIBUTES)
        + " | mean | PSNR dB vs off |",
        "|---|" + "---:|" * (len(ATTRIBUTES) + 9),
    ]
    for label, tally in tallies.items():
        rates = tally.accuracy.rates()
        mean = 100 * sum(rates.values()) / len(rates)
        psnr = "ref" if tally is off else f"{pooled_psnr(tally.images, off.images):.2f}"
        wall, off_wall = sum(tally.group_wall_s), sum(off.group_wall_s)
        cells = [
            label,
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
