"""Engine overhead and batching gain, measured side by side in one process.

Three contenders take turns, round after round, so machine noise hits them alike:
  direct     the diffusers pipeline called with the 8 prompts in one call
  engine-8   8 concurrent callers through AsyncEngine, max_num_seqs=8
  engine-1   the same callers, max_num_seqs=1 (no request batching)
Prints images/s for each and the ratios engine-8/direct (target >= 0.95) and
engine-8/engine-1 (the batching gain).

    python -m bench.bench_engine --model tiny-sd --steps 8 --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.engine import AsyncEngine
from engine.executor import ThreadExecutor
from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.text_to_image import DiffusersTextToImage

PROMPTS = [
    "a cat",
    "an astronaut riding a horse on the moon",
    "a watercolor painting of a mountain lake at dawn",
    "portrait of an old man with a beard, highly detailed",
    "a bowl of fruit on a wooden table",
    "city street at night with neon signs and rain",
    "a dog running through a field of flowers",
    "a castle on a hill under a starry sky",
]


def direct_call(pipeline: DiffusersTextToImage, params: SamplingParams) -> float:
    generators = [torch.Generator("cpu").manual_seed(i) for i in range(len(PROMPTS))]
    start = time.perf_counter()
    with torch.inference_mode():
        pipeline.pipe(
            prompt=PROMPTS,
            negative_prompt=[""] * len(PROMPTS),
            width=params.width,
            height=params.height,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            generator=generators,
            output_type="np",
        )
    return time.perf_counter() - start


async def engine_round(engine: AsyncEngine, params: SamplingParams) -> float:
    start = time.perf_counter()
    await asyncio.gather(
        *(
            engine.generate(GenerationRequest.create(p, replace(params, seed=i)))
            for i, p in enumerate(PROMPTS)
        )
    )
    return time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    config = PipelineConfig(model=args.model, num_threads=args.threads)
    params = SamplingParams(
        width=args.size, height=args.size, num_inference_steps=args.steps, guidance_scale=7.5
    )
    direct = load_pipeline(config)
    assert isinstance(direct, DiffusersTextToImage), "the direct baseline calls a diffusers pipeline"
    engines = {
        name: AsyncEngine(ThreadExecutor.for_config(config), EngineConfig(max_num_seqs=seqs))
        for name, seqs in (("engine-8", 8), ("engine-1", 1))
    }
    for engine in engines.values():
        await engine.start()
    times: dict[str, list[float]] = {"direct": [], **{name: [] for name in engines}}
    try:
        direct_call(direct, params)  # warm-up of every contender
        for engine in engines.values():
            await engine_round(engine, params)
        for _ in range(args.rounds):
            times["direct"].append(direct_call(direct, params))
            for name, engine in engines.items():
                times[name].append(await engine_round(engine, params))
    finally:
        for engine in engines.values():
            await engine.stop()
    print(
        f"model={args.model} size={args.size} steps={args.steps} threads={args.threads} "
        f"rounds={args.rounds} images/round={len(PROMPTS)}"
    )
    rate = {name: len(PROMPTS) / statistics.median(t) for name, t in times.items()}
    for name, value in rate.items():
        print(f"  {name:9s} {value:7.2f} images/s (median of {args.rounds})")
    print(f"engine-8 / direct   = {rate['engine-8'] / rate['direct']:.3f}  (target >= 0.95)")
    print(f"engine-8 / engine-1 = {rate['engine-8'] / rate['engine-1']:.2f}x  (request batching gain)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
