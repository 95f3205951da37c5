"""LoRA adapters: what a forward costs with an adapter, and what switching adapters costs.

    python -m bench.lora --model tiny-sd --forwards 12

Loads the pipeline once with two tiny adapters and times, side by side in rounds, batched
forwards of `--batch` requests (`--steps` steps) in six patterns: the base model; one
adapter on every forward; two adapters alternating (both kept loaded); the same with
`max_loras 1` (each switch unloads one adapter and loads the other); and step-level
batching of two groups arriving together, without adapters and with one adapter each.
Prints the median seconds per forward and each pattern's ratio to the base. Threads:
`--threads` (default 2).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.request import GenerationRequest, LoraRef, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline

ADAPTERS = (("a", "tiny-lora-1"), ("b", "tiny-lora-2"))


def batch(pipeline: DiffusersAdapter, adapter: str | None, size: int, steps: int) -> RequestBatch:
    lora = None if adapter is None else LoraRef(adapter)
    requests = []
    for seed in range(size):
        sent = GenerationRequest.create(
            f"a lighthouse {seed}", SamplingParams(seed=seed, num_inference_steps=steps)
        )
        sent = sent.with_params(replace(pipeline.resolve(sent), lora=lora))
        requests.append(sent)
    return RequestBatch(pipeline.batch_key(requests[0]), tuple(requests))


def stepped(pipeline: DiffusersAdapter, first: RequestBatch, second: RequestBatch) -> None:
    """Two groups (one per adapter, when they have one) arriving together, as the step
    engine runs them: both prepared at once (a switch per adapter), then the older group
    steps to its end (its key is the oldest request's), then the other."""
    groups = [pipeline.prepare(list(first.requests)), pipeline.prepare(list(second.requests))]
    for group in groups:
        while not all(state.is_done for state in group):
            pipeline.step(group)
        pipeline.finish(group)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--batch", type=int, default=4, help="requests per forward")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--forwards", type=int, default=12, help="forwards timed per pattern")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PipelineConfig(model=args.model, num_threads=args.threads, lora_modules=ADAPTERS)
    kept, one = load_pipeline(config), load_pipeline(replace(config, max_loras=1))
    assert isinstance(kept, DiffusersAdapter) and isinstance(one, DiffusersAdapter)
    base, a, b = (batch(kept, adapter, args.batch, args.steps) for adapter in (None, "a", "b"))

    def forwards(pipeline: DiffusersAdapter, *batches: RequestBatch) -> Callable[[int], None]:
        """Forward i runs batches[i % len(batches)]."""

        def run(i: int) -> None:
            pipeline.forward(batches[i % len(batches)])

        return run

    patterns: dict[str, Callable[[int], None]] = {
        "base model": forwards(kept, base),
        "one adapter": forwards(kept, a),
        "two alternating, both loaded": forwards(kept, a, b),
        "two alternating, max_loras 1": forwards(one, a, b),
    }
    if kept.supports_step_batch:
        # Two forwards' worth of work per call: timed per forward below. Without adapters
        # first, so the adapters' own cost in step mode reads as the ratio of the two.
        patterns["step level, two groups, no adapter"] = lambda i: stepped(kept, base, base)
        patterns["step level, two adapters' groups"] = lambda i: stepped(kept, a, b)
    times: dict[str, list[float]] = {name: [] for name in patterns}
    for warm_up in patterns.values():  # load both adapters, pay first-call costs
        warm_up(0)
        warm_up(1)
    for i in range(args.forwards):  # rounds: each pattern once per round, side by side
        for name, run in patterns.items():
            start = time.perf_counter()
            run(i)
            seconds = time.perf_counter() - start
            times[name].append(seconds / 2 if name.startswith("step") else seconds)
    reference = statistics.median(times["base model"])
    print(f"{args.model}: {args.batch} requests x {args.steps} steps per forward, {args.threads} threads")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:36s} {median * 1000:8.1f} ms/forward   {median / reference:5.2f}x base")


if __name__ == "__main__":
    main()
