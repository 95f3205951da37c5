"""Memory and speed of a full-size random-weight model (bench/fullsize.py) served at a small
size, plain and fitted, each scheme in a process of its own:

    python -m bench.fullsize_memory --model random-sdxl --size 256 --schemes none,layerwise,group-disk
    python -m bench.fullsize_memory --device cuda --model random-flux --size 512 \\
        --schemes none,layerwise,int8,model,group,sequential

Per scheme: memory once loaded and fitted, the peak while serving `--requests` requests of
2 steps one after another, and images/s. On the CPU memory is the process's resident set
(`VmHWM`, reset after the load by writing 5 to `/proc/self/clear_refs`; Linux only); on
CUDA it is `torch.cuda.max_memory_allocated` (reset after the load), and the clock is read
after a `torch.cuda.synchronize()` at both ends (a forward ends with its images on the host
anyway). Loading itself peaks at the bf16 size in every scheme that casts or offloads after
building (the weights are built in bf16): the serving figures are what a fitted model holds.
A scheme this host cannot run is refused by the settings' own checks and reported as such.

On the CPU the resident set is also split by kind (`bench/resident.py`, sampled every 5 ms
from load to the last request): anonymous pages (`RssAnon`: tensors, heap; memory really
held) apart from file-backed ones (`RssFile`: files mapped in, such as group offload's
safetensors files read back through mmap, page cache the kernel can drop), as loaded, their
peaks while loading, and their peaks while serving.

Children run with `MALLOC_MMAP_THRESHOLD_=131072`: glibc otherwise raises its mmap threshold
after large frees, and the per-layer upcasts of layerwise casting then churn the heap, whose
free space is never handed back (measured: a serving peak 1.8 GB above the loaded size on
SDXL with float8 weights, none of it live). Fixed, every tensor above 128 KiB is its own
mapping, returned to the system when freed, so the resident peak is what was live.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.resident import ResidentSampler, read_status

_STATUS = Path("/proc/self/status")
CLASSES = {"random-sdxl": "bench.fullsize:RandomSDXL", "random-flux": "bench.fullsize:RandomFlux"}


def _mib(field: str) -> float:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def memory_for(scheme: str) -> Any:
    from pipelines.memory.options import MemoryConfig, Quantization

    disk = tempfile.mkdtemp(prefix="offload-")
    return {
        "none": MemoryConfig(),
        "layerwise": MemoryConfig(quantization=Quantization("layerwise", "float8_e4m3fn")),
        "int8": MemoryConfig(quantization=Quantization("torchao", "int8wo")),
        "float8": MemoryConfig(quantization=Quantization("torchao", "float8wo")),
        "model": MemoryConfig(offload="model"),
        "group": MemoryConfig(offload="group"),
        "group-disk": MemoryConfig(offload="group", offload_to_disk=disk),
        "sequential": MemoryConfig(offload="sequential"),
    }[scheme]


def run_scheme(args: argparse.Namespace) -> dict[str, Any]:
    """In this process: load `--model` fitted by `--one`, serve `--requests` requests of 2 steps."""
    model, scheme, device, size, requests = args.model, args.one, args.device, args.size, args.requests
    import torch

    from engine.request import GenerationRequest, RequestBatch, SamplingParams
    from pipelines.base import PipelineConfig
    from pipelines.memory.options import check_device, check_packages
    from pipelines.registry import load_pipeline

    memory = memory_for(scheme)
    sampler = ResidentSampler()
    sampler.start()
    check_device(memory, device)
    check_packages(memory)
    config = PipelineConfig(
        model=model,
        device=device,
        dtype="bfloat16",
        pipeline_class=CLASSES[model],
        num_threads=args.threads,
        memory=memory,
    )
    pipeline: Any = load_pipeline(config)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        loaded = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        loaded = _mib("VmRSS")
        at_load = {**read_status(), **{f"load_peak_{k}": v for k, v in sampler.sample().items()}}
        Path("/proc/self/clear_refs").write_text("5")
        sampler.reset()
    params = SamplingParams(width=size, height=size, num_inference_steps=2, guidance_scale=1.0)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for seed in range(requests):
        request = GenerationRequest.create("a cat", replace(params, seed=seed))
        request = request.with_params(pipeline.resolve(request))
        pipeline.forward(RequestBatch(key=(), requests=(request,)))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _mib("VmHWM")
    serving = sampler.stop()
    row = {
        "scheme": scheme,
        "loaded_mib": round(loaded),
        "serving_peak_mib": round(peak),
        "images_per_s": round(requests / elapsed, 3),
    }
    if not cuda:  # the resident set's kinds (bench/resident.py): anonymous apart from file-backed
        row |= {
            "loaded_anon_mib": round(at_load["RssAnon"]),
            "loaded_file_mib": round(at_load["RssFile"]),
            "load_peak_anon_mib": round(at_load["load_peak_RssAnon"]),
            "load_peak_file_mib": round(at_load["load_peak_RssFile"]),
            "serving_peak_anon_mib": round(serving["RssAnon"]),
            "serving_peak_file_mib": round(serving["RssFile"]),
        }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-sdxl", choices=sorted(CLASSES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schemes", default="none,layerwise,group-disk")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one scheme
    args = parser.parse_args()
    if args.one:
        row = run_scheme(args)
        print(json.dumps(row))
        return 0
    rows, failed = [], False
    for scheme in args.schemes.split(","):
        command = [sys.executable, "-m", "bench.fullsize_memory", "--model", args.model, "--one", scheme]
        command += ["--device", args.device, "--size", str(args.size), "--requests", str(args.requests)]
        command += ["--threads", str(args.threads)]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            failed = True
            print(f"{scheme}: failed\n{done.stderr[-2000:]}", file=sys.stderr, flush=True)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["serving_peak_mib"] if rows else 1
    print(f"{args.model} {args.size}x{args.size} on {args.device}, {args.requests} requests of 2 steps")
    print(
        f"{'scheme':>11}  {'loaded MiB':>10}  {'anon':>6}  {'peak MiB':>8}  {'x first':>7}  "
        f"{'peak anon':>9}  {'peak file':>9}  {'load peak anon':>14}  {'images/s':>8}"
    )
    for row in rows:
        print(
            f"{row['scheme']:>11}  {row['loaded_mib']:>10}  {row.get('loaded_anon_mib', '-'):>6}  "
            f"{row['serving_peak_mib']:>8}  {row['serving_peak_mib'] / base:>7.2f}  "
            f"{row.get('serving_peak_anon_mib', '-'):>9}  {row.get('serving_peak_file_mib', '-'):>9}  "
            f"{row.get('load_peak_anon_mib', '-'):>14}  {row['images_per_s']:>8}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
