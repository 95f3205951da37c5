"""What a cache mode buys and costs in step mode, in process (no HTTP): the held-out
shapes prompts (`pipelines.trained.captions`, 64x64, the model's default steps) in step
groups of `--group` requests, once per setting (and once with the cache off), the settings
taking turns group by group so a noisy machine hits them alike. Per setting: images/s
(prepare, steps and decode), seconds in the denoiser steps, steps and blocks skipped per
request, adherence per attribute (`bench.quality`) and PSNR against the cache-off pictures.
First-Block Cache's settings are thresholds; TaylorSeer's are INTERVAL/WARMUP/ORDER.

    python -m bench.cache_quality --model shapes-dit --thresholds 0.1,0.25
    python -m bench.cache_quality --model shapes-dit --mode taylorseer --settings 2/2/1,3/2/1
"""

from __future__ import annotations

import argparse
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
    """One threshold's pictures and times, added up over groups."""

    images: list[np.ndarray] = field(default_factory=list)
    wall_s: float = 0.0
    step_s: float = 0.0
    steps_skipped: int = 0
    blocks_skipped: int = 0
    accuracy: Accuracy = field(default_factory=Accuracy)


def run_group(pipeline: Any, prompts: list[tuple[str, int]], choice: CacheChoice, tally: Tally) -> None:
    requests = []
    for prompt, seed in prompts:
        params = SamplingParams(width=64, height=64, seed=seed, cache=choice)
        request = GenerationRequest.create(prompt, params)
        requests.append(request.with_params(pipeline.resolve(request)))
    start = time.perf_counter()
    states = pipeline.prepare(requests)
    stepping = time.perf_counter()
    while not all(state.is_done for state in states):
        pipeline.step([state for state in states if not state.is_done])
    tally.step_s += time.perf_counter() - stepping
    outputs = pipeline.finish(states)
    tally.wall_s += time.perf_counter() - start
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
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    choices = choices_of(args.mode, args.settings if args.mode == "taylorseer" else args.thresholds)
    labels = list(choices)
    pipeline = load_pipeline(PipelineConfig(model=args.model, num_threads=args.threads))
    prompts = list(zip(HELD_OUT_PROMPTS, HELD_OUT_SEEDS, strict=True))
    tallies = {label: Tally() for label in labels}
    run_group(pipeline, prompts[:1], choices[labels[-1]], Tally())  # warm-up, unmeasured
    for index, start in enumerate(range(0, len(prompts), args.group)):
        group = prompts[start : start + args.group]
        turn = index % len(labels)
        for label in labels[turn:] + labels[:turn]:
            run_group(pipeline, group, choices[label], tallies[label])
    setting = "interval/warmup/order" if args.mode == "taylorseer" else "threshold"
    print(report(tallies, len(prompts), setting))


def report(tallies: dict[str, Tally], count: int, setting: str = "threshold") -> str:
    off = tallies["off"]
    lines = [
        f"| {setting} | images/s | ÷off | step s | ÷off | steps skipped/req | blocks skipped/req | "
        + " | ".join(ATTRIBUTES)
        + " | mean | PSNR dB vs off |",
        "|---|" + "---:|" * (len(ATTRIBUTES) + 8),
    ]
    for label, tally in tallies.items():
        rates = tally.accuracy.rates()
        mean = 100 * sum(rates.values()) / len(rates)
        psnr = "ref" if tally is off else f"{pooled_psnr(tally.images, off.images):.2f}"
        cells = [
            label,
            f"{count / tally.wall_s:.2f}",
            f"{off.wall_s / tally.wall_s:.2f}",
            f"{tally.step_s:.1f}",
            f"{off.step_s / tally.step_s:.2f}",
            f"{tally.steps_skipped / count:.1f}",
            f"{tally.blocks_skipped / count:.1f}",
            *(f"{100 * rates[a]:.0f}%" for a in ATTRIBUTES if a in rates),
            f"{mean:.1f}%",
            psnr,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
