"""Where a step group's time goes with First-Block Cache off and on, in process: one group
of the held-out shapes prompts (`bench.cache_quality`'s) per setting and round, the settings
taking turns, each timed by stage (prepare, steps, decode) and, inside the steps, by part of
the denoiser (the first block, the rest of the blocks, the rest of the transformer) and the
cache's own bookkeeping (decisions, cutting rows, putting rows back). Medians over rounds.
What skipping can save is the rest of the blocks' share: the rest is paid at every step.

    python -m bench.cache_profile --model shapes-dit --threshold 0.25 --rounds 5 --threads 1

Host clocks around synchronous CPU work; on an accelerator the figures would need its events.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import torch

from bench.cache_quality import Shape, run_group
from engine.request import CacheChoice
from pipelines.base import PipelineConfig
from pipelines.cache.block_hooks import denoiser_blocks
from pipelines.cache.first_block import CachedForward, CachedStep
from pipelines.registry import load_pipeline
from pipelines.trained.captions import HELD_OUT_PROMPTS, HELD_OUT_SEEDS

Clock = dict[str, float]


def _timed(clock: Clock, part: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            clock[part] += time.perf_counter() - start

    return timed


@contextmanager
def clocked(pipeline: Any, clock: Clock) -> Iterator[None]:
    """Time the stages, the denoiser's parts and the cache's bookkeeping into `clock`."""
    transformer = pipeline.family.cached_denoisers()[0]  # the first expert's, with two
    blocks = denoiser_blocks(transformer)
    starts: dict[int, float] = {}

    def before(module: torch.nn.Module, *_: Any) -> None:
        starts[id(module)] = time.perf_counter()

    def after(part: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, *_: Any) -> None:
            clock[part] += time.perf_counter() - starts.pop(id(module))

        return hook

    handles = []
    for module, part in [(transformer, "denoiser"), (blocks[0], "first block")] + [
        (block, "rest of the blocks") for block in blocks[1:]
    ]:
        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after(part))]
    patches = [
        patch.object(pipeline, stage, _timed(clock, stage, getattr(pipeline, stage)))
        for stage in ("prepare", "step", "finish")
    ] + [
        patch.object(owner, name, _timed(clock, "cache bookkeeping", getattr(owner, name)))
        for owner, name in (
            (CachedForward, "decide"),
            (CachedForward, "rows_of"),
            (CachedForward, "assemble"),
            (CachedStep, "commit"),
        )
    ]
    try:
        for each in patches:
            each.start()
        yield
    finally:
        for each in patches:
            each.stop()
        for handle in handles:
            handle.remove()


PARTS = ("prepare", "step", "finish", "first block", "rest of the blocks", "denoiser", "cache bookkeeping")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="shapes-dit")
    parser.add_argument("--threshold", type=float, default=0.25)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipeline = load_pipeline(PipelineConfig(model=args.model, num_threads=args.threads))
    group = list(zip(HELD_OUT_PROMPTS, HELD_OUT_SEEDS, strict=True))[: args.group]
    shape = Shape(args.size, args.steps)
    settings: list[float] = [0.0, args.threshold]
    for threshold in settings:
        run_group(pipeline, group, CacheChoice("first-block", threshold), shape, None)  # warm-up
    clocks: dict[float, list[Clock]] = {t: [] for t in settings}
    for round_ in range(args.rounds):
        for threshold in settings[round_ % 2 :] + settings[: round_ % 2]:
            clock: Clock = defaultdict(float)
            with clocked(pipeline, clock):
                run_group(pipeline, group, CacheChoice("first-block", threshold), shape, None)
            clocks[threshold].append(clock)
    print(report(clocks))


def report(clocks: dict[float, list[Clock]]) -> str:
    """Median ms per group of each part, and its share of the median step time."""
    lines = [
        "| threshold | " + " | ".join(f"{part} ms" for part in PARTS) + " | first block ÷ step "
        "| rest of the blocks ÷ step |",
        "|---|" + "---:|" * (len(PARTS) + 2),
    ]
    for threshold, runs in clocks.items():
        median = {part: 1000 * statistics.median(run[part] for run in runs) for part in PARTS}
        cells = ["off" if threshold == 0 else f"{threshold:g}", *(f"{median[p]:.1f}" for p in PARTS)]
        step = median["step"]
        cells += [f"{median['first block'] / step:.0%}", f"{median['rest of the blocks'] / step:.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
