"""Decode on the stepping thread or beside it: images/s of step-level batching in this
process, without HTTP, for `decode_overlap` off / on / auto, interleaved round by round.

A steady stream: every iteration `--group / --steps` requests arrive, so about `--group`
run at once and requests finish at every step — the case where a decode on the stepping
thread stalls everyone else. It drives the engine's own StepScheduler and StepRunner.

    python -m bench.decode_overlap --model tiny-qwen-image --steps 4
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

import torch

from engine.request import GenerationRequest, SamplingParams
from engine.sched.step_scheduler import StepScheduler
from engine.worker.decoding import DECODE_OVERLAP_CHOICES, DecodeOverlap
from engine.worker.stepping import StepRunner
from pipelines.base import Pipeline, PipelineConfig
from pipelines.registry import load_pipeline


def images_per_second(pipeline: Pipeline, mode: DecodeOverlap, steps: int, group: int, total: int) -> float:
    runner = StepRunner(pipeline, decode_overlap=mode)
    # Set: the runner returns after every step, so arrivals join at the next step as in the
    # engine under steady load.
    news = threading.Event()
    news.set()
    scheduler = StepScheduler(max_num_seqs=group)
    seeds = itertools.count()
    arrivals = max(1, group // steps)
    admitted = finished = 0
    start = time.perf_counter()
    while finished < total:
        for _ in range(min(arrivals, total - admitted)):
            params = SamplingParams(num_inference_steps=steps, seed=next(seeds))
            request = GenerationRequest.create("a red cat on the moon", params)
            request = request.with_params(pipeline.resolve(request))
            scheduler.add(request, pipeline.step_key(request))
            admitted += 1
        plan = scheduler.schedule()
        if plan is None:
            continue
        output = runner.run(plan, news)
        scheduler.release(output.decoding)
        finished += len(scheduler.finish([*output.outputs, *output.errors]))
    runner.close()
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-qwen-image")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group", type=int, default=8, help="requests running at once")
    parser.add_argument("--requests", type=int, default=96, help="requests per round and mode")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipeline = load_pipeline(PipelineConfig(model=args.model, num_threads=args.threads))
    if not pipeline.supports_step_batch:
        raise SystemExit(f"{args.model} is not served step-level")
    images_per_second(pipeline, "off", args.steps, args.group, args.group)  # warm-up
    results: dict[DecodeOverlap, list[float]] = {mode: [] for mode in DECODE_OVERLAP_CHOICES}
    for round_ in range(args.rounds):
        modes = DECODE_OVERLAP_CHOICES[round_ % 3 :] + DECODE_OVERLAP_CHOICES[: round_ % 3]
        for mode in modes:  # who goes first rotates
            results[mode].append(images_per_second(pipeline, mode, args.steps, args.group, args.requests))
    off = statistics.median(results["off"])
    print(f"model={args.model} steps={args.steps} group={args.group} threads={args.threads}", end=" ")
    print(f"rounds={args.rounds}")
    print("| decode_overlap | images/s (median) | ÷ off | rounds |")
    print("|---|---:|---:|---|")
    for mode, values in results.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {mode} | {median:.1f} | {median / off:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
