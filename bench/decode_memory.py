"""Peak host memory of one finish (the decode stage) with and without a decode budget:
`python -m bench.decode_memory --model tiny-sd --size 512 --requests 8 --budget-images 2`.

The peak is the process's resident high-water mark (`VmHWM`, reset before each finish by
writing 5 to `/proc/self/clear_refs`) less its resident size just before: what the finish
added at its highest. Linux only; on a GPU read `torch.cuda.max_memory_allocated` instead.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.request import GenerationRequest, RequestOutput, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.decode import HalvingDecode
from pipelines.memory.decode_budget import DecodeBudget
from pipelines.memory.options import MemoryConfig
from pipelines.registry import load_pipeline

_STATUS = Path("/proc/self/status")


def _kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in {_STATUS}")


def finish_peak(pipeline: Any, states: list[Any]) -> tuple[int, list[RequestOutput]]:
    """Bytes the finish of `states` added to the resident set at its peak, and its outputs."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    outputs = pipeline.finish(states)
    return (_kib("VmHWM") - before) * 1024, outputs


def measure(
    model: str, size: int, requests: int, budget_images: int, *, threads: int = 2, rounds: int = 3
) -> dict[str, Any]:
    """Prepare `requests` requests at size² and finish them (the decode stage: the initial
    latents stand for denoised ones, as no step changes a decode's cost; tiny-sd's UNet
    attends over 128² tokens at 512², minutes a step on this CPU) with no budget and with a
    budget of `budget_images` images, alternately (`rounds` each; the least of each, as
    other allocations only add). Also the largest difference between their images."""
    budget = budget_images * size * size
    pipeline: Any = load_pipeline(
        PipelineConfig(model=model, num_threads=threads, memory=MemoryConfig(decode_budget=budget))
    )
    decode = pipeline.pipe.vae.decode
    assert isinstance(decode, HalvingDecode) and isinstance(decode.limit, DecodeBudget)
    limit = decode.limit
    params = SamplingParams(width=size, height=size, num_inference_steps=1, guidance_scale=1.0)
    batch = []
    for seed in range(requests):
        request = GenerationRequest.create(f"request {seed}", replace(params, seed=seed))
        batch.append(request.with_params(pipeline.resolve(request)))
    states = pipeline.prepare(batch)
    peaks: dict[str, list[int]] = {"whole": [], "budget": []}
    images: dict[str, list[np.ndarray]] = {}
    for _ in range(rounds):
        for name, bound in (("whole", None), ("budget", limit)):
            decode.limit = bound
            peak, outputs = finish_peak(pipeline, states)
            peaks[name].append(peak)
            images[name] = [image for output in outputs for image in output.images]
    whole, cut = min(peaks["whole"]), min(peaks["budget"])
    levels = max(
        int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
        for a, b in zip(images["whole"], images["budget"], strict=True)
    )
    return {
        "model": model,
        "size": size,
        "requests": requests,
        "budget_images": budget_images,
        "whole_peak_mib": round(whole / 2**20, 1),
        "budget_peak_mib": round(cut / 2**20, 1),
        "ratio": round(cut / whole, 3),
        "max_difference_levels": levels,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--budget-images", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.size, args.requests, args.budget_images, threads=args.threads)))


if __name__ == "__main__":
    main()
