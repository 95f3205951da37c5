"""Time the step-level stages of one model in this process: prepare (encode + latents), one
batched denoising step, and finish (decode), for groups of 1, 4 and 8 requests.

It shows whether a family is denoiser-bound or decode-bound, which decides how much step
mode gains and what pooling decodes is worth (docs/architecture.md, docs/benchmarks.md).

    python -m bench.stage_times --model tiny-qwen-image --steps 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import Pipeline, PipelineConfig
from pipelines.registry import load_pipeline


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def time_group(
    pipeline: Pipeline, group: list[GenerationRequest], repeats: int
) -> tuple[float, float, float]:
    """Median ms of prepare, of one step (prepare + step, less prepare), and of finish."""
    prepare = median_ms(lambda: pipeline.prepare(group), repeats)
    step = median_ms(lambda: pipeline.step(pipeline.prepare(group)), repeats) - prepare
    states = pipeline.prepare(group)
    return prepare, step, median_ms(lambda: pipeline.finish(states), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipeline = load_pipeline(PipelineConfig(model=args.model, num_threads=args.threads))
    if not pipeline.supports_step_batch:
        raise SystemExit(f"{args.model} is not served step-level")
    print(f"model={args.model} steps={args.steps} threads={args.threads} (median of {args.repeats}, ms)")
    for k in (1, 4, 8):
        group = []
        for i in range(k):
            params = SamplingParams(num_inference_steps=args.steps, seed=i)
            request = GenerationRequest.create(f"a cat number {i}", params)
            group.append(request.with_params(pipeline.resolve(request)))
        prepare, step, finish = time_group(pipeline, group, args.repeats)
        print(
            f"  {k} request(s): prepare {prepare:6.1f}  one step {step:6.1f}  finish (decode) {finish:6.1f}"
        )


if __name__ == "__main__":
    main()
