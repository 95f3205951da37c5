"""Measure the prompt and result caches (issue 27), side by side in one run.

`prompt`: a closed loop in this process (the engine, step-level, the pipeline in a thread):
`--clients` clients share one prompt, each sending `--requests` requests with seeds of its
own, once without the prompt cache and once with it. Time in the text encoders is taken by
forward hooks on every text encoder of the pipeline, whoever calls them.

`result`: a real server with `--result-cache-mb`; one request with a seed, then `--repeats`
exact repeats: the server's own time per repeat (its request-latency histogram, sum over
count) and the client's round trip on loopback.

    python -m bench.caches prompt --model tiny-sd --threads 2
    python -m bench.caches result --repeats 50
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.launch import start_server, stop_server
from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline

PROMPT = "a red cat on the moon"
_ENDPOINT = 'endpoint="/v1/images/generations"'


class EncoderClock:
    """Seconds and calls spent in a pipeline's text encoders (forward hooks)."""

    def __init__(self, pipe: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._started: dict[int, float] = {}
        for name, component in pipe.components.items():
            if name.startswith("text_encoder") and isinstance(component, torch.nn.Module):
                component.register_forward_pre_hook(self._enter)
                component.register_forward_hook(self._leave)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._started[id(module)] = time.perf_counter()

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.seconds += time.perf_counter() - self._started.pop(id(module))
        self.calls += 1


async def closed_loop(args: argparse.Namespace, cache_mb: float) -> dict[str, Any]:
    """One closed loop over a fresh pipeline: wall time, encoder time and calls, cache counts."""
    config = PipelineConfig(model=args.model, num_threads=args.threads, prompt_cache_mb=cache_mb)
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter)
    clock = EncoderClock(pipeline.pipe)
    engine = AsyncEngine(
        ThreadExecutor(lambda: pipeline), EngineConfig(max_num_seqs=args.clients, batching="step")
    )
    await engine.start()

    async def client(index: int) -> None:
        for i in range(args.requests):
            params = SamplingParams(num_inference_steps=args.steps, seed=index * 1000 + i)
            await engine.generate(GenerationRequest.create(PROMPT, params))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(client(i) for i in range(args.clients)))
    finally:
        await engine.stop()
    counts = pipeline.prompt_cache_counts() or {}
    wall = time.perf_counter() - start
    return {"wall_s": wall, "encode_s": clock.seconds, "encoder_calls": clock.calls, **counts}


def prompt_part(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    runs = {}
    for label, mb in (("off", 0.0), ("on", args.prompt_cache_mb)):
        runs[label] = asyncio.run(closed_loop(args, mb))
        run = runs[label]
        print(
            f"prompt cache {label:>3}: {args.clients * args.requests} requests in {run['wall_s']:.2f} s, "
            f"text encoders {run['encode_s'] * 1000:.1f} ms in {run['encoder_calls']} calls"
            + (f", hits {run['hits']:.0f} misses {run['misses']:.0f}" if "hits" in run else "")
        )
    ratio = runs["off"]["encode_s"] / max(runs["on"]["encode_s"], 1e-9)
    print(f"time encoding, off / on: {ratio:.1f}x")


def _latency(server: Any) -> tuple[float, float]:
    """(sum, count) of the server's request-latency histogram for image generations."""
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("diffbatch_request_latency_seconds_") and _ENDPOINT in line:
            name = line.split("{", 1)[0].rsplit("_", 1)[1]
            values[name] = float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


def result_part(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(Path(workdir), "--result-cache-mb", "64", "--num-threads", str(args.threads))
        try:
            body = {"prompt": PROMPT, "size": "64x64", "seed": 7}
            with httpx.Client(base_url=server.url, timeout=120) as client:
                start = time.perf_counter()
                first = client.post("/v1/images/generations", json=body).json()
                miss_s = time.perf_counter() - start
                total, count = _latency(server)
                round_trips = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    again = client.post("/v1/images/generations", json=body).json()
                    round_trips.append(time.perf_counter() - start)
                    assert again["data"] == first["data"]
                after_total, after_count = _latency(server)
            server_ms = (after_total - total) / (after_count - count) * 1000
            print(f"first request (ran): {miss_s * 1000:.1f} ms round trip")
            print(
                f"{args.repeats} repeats (result cache hits): server {server_ms:.2f} ms each (mean), "
                f"round trip median {statistics.median(round_trips) * 1000:.2f} ms, "
                f"max {max(round_trips) * 1000:.2f} ms"
            )
        finally:
            stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["prompt", "result"])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompt-cache-mb", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    prompt_part(args) if args.part == "prompt" else result_part(args)


if __name__ == "__main__":
    main()
