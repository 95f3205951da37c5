"""HTTP load: the real server with and without request batching, and against direct calls.

Contenders, measured in alternating rounds in one run (noise hits them alike):
  server-batch   `diffbatch serve` (tiny-sd preset: max_num_seqs 8, wait 20 ms), C clients
  server-seq1    the same with --max-num-seqs 1, C clients
  direct         the diffusers pipeline in this process, called with C prompts at once
Then a lone client: p50 of one request at a time, server vs a direct one-prompt call.

    python -m bench.bench_http --clients 8 --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.launch import ServerProcess, start_server, stop_server
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.text_to_image import DiffusersTextToImage


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def load_round(
    server: ServerProcess, clients: int, per_client: int, steps: int
) -> tuple[float, list[float]]:
    """C closed-loop clients, each sending `per_client` requests; returns (seconds, latencies)."""
    latencies: list[float] = []

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        for j in range(per_client):
            body = {"prompt": f"client {index} request {j}", "size": "64x64", "num_inference_steps": steps}
            start = time.perf_counter()
            response = await client.post("/images/generations", json=body)
            latencies.append(time.perf_counter() - start)
            response.raise_for_status()

    async with httpx.AsyncClient(base_url=server.v1, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, i) for i in range(clients)))
        return time.perf_counter() - start, latencies


def direct_round(pipeline: DiffusersTextToImage, prompts: list[str], steps: int) -> float:
    generators = [torch.Generator("cpu").manual_seed(i) for i in range(len(prompts))]
    start = time.perf_counter()
    with torch.inference_mode():
        pipeline.pipe(
            prompt=prompts,
            negative_prompt=[""] * len(prompts),
            width=64,
            height=64,
            num_inference_steps=steps,
            generator=generators,
            output_type="np",
        )
    return time.perf_counter() - start


async def lone_client(
    name: str, server: ServerProcess, pipeline: DiffusersTextToImage, requests: int, steps: int
) -> None:
    server_times: list[float] = []
    direct_times: list[float] = []
    before = {name: server.metric(name) for name in _SPLIT}
    async with httpx.AsyncClient(base_url=server.v1, timeout=600) as client:
        for i in range(requests):  # interleaved, one at a time
            start = time.perf_counter()
            response = await client.post(
                "/images/generations",
                json={"prompt": f"lone {i}", "size": "64x64", "num_inference_steps": steps},
            )
            server_times.append(time.perf_counter() - start)
            response.raise_for_status()
            direct_times.append(direct_round(pipeline, [f"lone {i}"], steps))
    server_p50, direct_p50 = statistics.median(server_times), statistics.median(direct_times)
    print(
        f"lone client on {name} ({requests} requests, {steps} steps): server p50 {server_p50 * 1000:.1f} ms, "
        f"direct p50 {direct_p50 * 1000:.1f} ms, overhead {(server_p50 - direct_p50) * 1000:+.1f} ms "
        "(target <= 10 ms)"
    )
    # Where the time goes inside the server, from its own metrics (means per request).
    mean = {name: (server.metric(name) - before[name]) / requests * 1000 for name in _SPLIT}
    latency, forward, queue = mean.values()
    print(
        f"    in the server: latency {latency:.1f} ms = queue wait {queue:.1f} + forward {forward:.1f} "
        f"+ HTTP/encoding {latency - forward - queue:.1f} ms"
    )


_SPLIT = (
    'diffbatch_request_latency_seconds_sum{endpoint="/v1/images/generations"}',
    "diffbatch_forward_seconds_sum",
    "diffbatch_queue_wait_seconds_sum",
)


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    pipeline = load_pipeline(PipelineConfig(model="tiny-sd", num_threads=args.threads))
    assert isinstance(pipeline, DiffusersTextToImage)
    workdir = Path(tempfile.mkdtemp(prefix="diffbatch-bench-"))
    threads = ("--num-threads", str(args.threads))
    servers = {
        "server-batch": start_server(workdir, *threads),
        "server-seq1": start_server(workdir, *threads, "--max-num-seqs", "1"),
    }
    prompts = [f"direct prompt {i}" for i in range(args.clients)]
    seconds: dict[str, list[float]] = {"direct": [], **{name: [] for name in servers}}
    latencies: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for server in servers.values():  # warm-up
            await load_round(server, args.clients, 1, args.steps)
        direct_round(pipeline, prompts, args.steps)
        for _ in range(args.rounds):
            for name, server in servers.items():
                elapsed, lat = await load_round(server, args.clients, args.per_client, args.steps)
                seconds[name].append(elapsed)
                latencies[name].extend(lat)
            seconds["direct"].append(
                sum(direct_round(pipeline, prompts, args.steps) for _ in range(args.per_client))
            )
        print(
            f"clients={args.clients} per_client={args.per_client} rounds={args.rounds} steps={args.steps} "
            f"size=64x64 threads={args.threads}"
        )
        images = args.clients * args.per_client
        rate = {name: images / statistics.median(s) for name, s in seconds.items()}
        for name, value in rate.items():
            line = f"  {name:13s} {value:6.2f} images/s"
            if name in latencies:
                lat = latencies[name]
                line += (
                    "  latency p50/p90/p99 "
                    + "/".join(f"{percentile(lat, q) * 1000:.0f}" for q in (50, 90, 99))
                    + " ms"
                )
            print(line)
        print(
            f"server-batch / server-seq1 = {rate['server-batch'] / rate['server-seq1']:.2f}x (batching gain)"
        )
        print(f"server-batch / direct      = {rate['server-batch'] / rate['direct']:.3f} (target >= 0.90)")
        # server-seq1 has no admission wait (a batch of one is always full): it shows the
        # overhead without the quiet window that server-batch's 20 ms wait adds.
        for name, server in servers.items():
            await lone_client(name, server, pipeline, args.lone_requests, args.lone_steps)
    finally:
        for server in servers.values():
            stop_server(server)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lone-requests", type=int, default=30)
    # Few steps for the lone client: the overhead is absolute, and a shorter forward has less noise.
    parser.add_argument("--lone-steps", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
