"""Host memory of a full-size random-weight model served at a small size for 2 steps, plain
(bf16) and fitted (layerwise float8 weights, group offload to disk), each in a process of
its own: `python -m bench.fullsize_memory --model random-sdxl --size 256 --schemes
none,layerwise,group-disk`.

Per scheme: resident memory once loaded and fitted, and the resident high-water mark over
two requests of 2 steps each (`VmHWM` reset after the load by writing 5 to
`/proc/self/clear_refs`; Linux only). Loading itself peaks at the bf16 size in every scheme
(the weights are built in bf16, then cast or offloaded): the serving figures are what a
fitted model holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
CLASSES = {"random-sdxl": "bench.fullsize:RandomSDXL", "random-flux": "bench.fullsize:RandomFlux"}


def _mib(field: str) -> float:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def run_scheme(model: str, scheme: str, size: int, threads: int) -> dict[str, Any]:
    """In this process: load `model` fitted by `scheme`, serve 2 requests of 2 steps."""
    from engine.request import GenerationRequest, RequestBatch, SamplingParams
    from pipelines.base import PipelineConfig
    from pipelines.memory.options import MemoryConfig, Quantization
    from pipelines.registry import load_pipeline

    memory = {
        "none": MemoryConfig(),
        "layerwise": MemoryConfig(quantization=Quantization("layerwise", "float8_e4m3fn")),
        "group-disk": MemoryConfig(offload="group", offload_to_disk=tempfile.mkdtemp(prefix="offload-")),
    }[scheme]
    config = PipelineConfig(
        model=model, dtype="bfloat16", pipeline_class=CLASSES[model], num_threads=threads, memory=memory
    )
    pipeline: Any = load_pipeline(config)
    loaded = _mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    params = SamplingParams(width=size, height=size, num_inference_steps=2, guidance_scale=1.0)
    for seed in range(2):
        request = GenerationRequest.create("a cat", replace(params, seed=seed))
        request = request.with_params(pipeline.resolve(request))
        pipeline.forward(RequestBatch(key=(), requests=(request,)))
    return {"scheme": scheme, "loaded_mib": round(loaded), "serving_peak_mib": round(_mib("VmHWM"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-sdxl", choices=sorted(CLASSES))
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schemes", default="none,layerwise,group-disk")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one scheme
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_scheme(args.model, args.one, args.size, args.threads)))
        return
    rows = []
    for scheme in args.schemes.split(","):
        command = [
            sys.executable,
            "-m",
            "bench.fullsize_memory",
            "--model",
            args.model,
            "--size",
            str(args.size),
        ]
        command += ["--threads", str(args.threads), "--one", scheme]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["serving_peak_mib"]
    for row in rows:
        print(
            f"{row['scheme']:>11}  loaded {row['loaded_mib']:>6} MiB  "
            f"serving peak {row['serving_peak_mib']:>6} MiB  "
            f"{row['serving_peak_mib'] / base:.2f}x of {rows[0]['scheme']}"
        )


if __name__ == "__main__":
    main()
