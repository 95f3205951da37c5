"""Ray Serve: the batch-key router against Ray's default router, on mixed-size load.

    python -m bench.ray_router --replicas 2 --clients 16 --requests 96

Starts a local Ray cluster, deploys `diffbatch serve --ray-address` once per router
(alternating, `--rounds` times each), drives each with the same closed loop of requests
drawn from `--sizes`, and prints per router the mean requests per forward (from the
gateway's /metrics, which gathers every replica's forwards) and images per second, then
the ratios batch-key / default. The mean batch is the router's doing; throughput on a
small CPU machine also depends on how busy it is, so read it with its spread.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.launch import ServerProcess, spawn_server, stop_server, wait_until_ready
from bench.ray_cluster import LocalCluster, start_cluster
from bench.server_metrics import figures_between, parse_metrics

ROUTERS = ("batch-key", "default")


def drive(server: ServerProcess, clients: int, requests: int, sizes: list[str], steps: int) -> float:
    """A closed loop: `clients` callers, `requests` in all, sizes in turn. Returns seconds."""
    counter = itertools.count()
    failures: list[str] = []

    def caller() -> None:
        with httpx.Client(timeout=600) as client:
            while (i := next(counter)) < requests:
                body = {"prompt": f"a cat {i}", "size": sizes[i % len(sizes)], "num_inference_steps": steps}
                response = client.post(f"{server.v1}/images/generations", json=body)
                if response.status_code != 200:
                    failures.append(response.text)

    threads = [threading.Thread(target=caller) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return time.perf_counter() - start


def measure(
    cluster: LocalCluster, router: str, args: argparse.Namespace, workdir: Path
) -> tuple[float, float]:
    server = spawn_server(
        workdir,
        "--ray-address", cluster.address, "--replicas", str(args.replicas), "--ray-router", router,
        "--max-num-seqs", str(args.max_num_seqs), "--num-threads", "1",
        config=args.config, env=cluster.env,
    )  # fmt: skip
    try:
        wait_until_ready(server, timeout_s=600)
        drive(server, args.clients, 4 * args.clients, args.sizes, args.steps)  # warm-up
        before = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        seconds = drive(server, args.clients, args.requests, args.sizes, args.steps)
        after = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    finally:
        stop_server(server)
    figures = figures_between(before, after)
    return figures.mean_batch or 0.0, args.requests / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="tiny-sd.yaml", help="preset in configs/ (default: tiny-sd.yaml)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=12, help="closed-loop callers (default: 12)")
    parser.add_argument("--requests", type=int, default=72, help="requests per measurement (default: 72)")
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=["64x64", "32x32"])
    parser.add_argument(
        "--steps", type=int, default=16, help="enough for requests to spend their time in the engines"
    )
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="deployments per router, alternating")
    args = parser.parse_args(argv)
    results: dict[str, list[tuple[float, float]]] = {router: [] for router in ROUTERS}
    cluster = start_cluster(num_cpus=args.replicas + 2)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            # The cluster's first deployment runs slower (measured: half the images/s, whichever
            # router): one unmeasured deployment first.
            measure(cluster, "default", args, Path(workdir))
            for round_index in range(args.rounds):
                order = ROUTERS if round_index % 2 == 0 else ROUTERS[::-1]
                for router in order:
                    batch, rate = measure(cluster, router, args, Path(workdir))
                    results[router].append((batch, rate))
                    print(
                        f"round {round_index + 1} {router:>9}: {batch:.2f} requests/forward, {rate:.2f} img/s"
                    )
    finally:
        leftover = cluster.stop()
        if leftover:
            print(f"warning: Ray processes left: {leftover}", file=sys.stderr)
    print()
    print(
        f"{args.replicas} replicas, {args.clients} clients, sizes {','.join(args.sizes)}, {args.steps} steps"
    )
    print("| router | mean requests per forward | images/s (mean of rounds) |")
    print("|---|---|---|")
    means = {}
    for router in ROUTERS:
        batch = statistics.mean(b for b, _ in results[router])
        rate = statistics.mean(r for _, r in results[router])
        means[router] = (batch, rate)
        print(f"| {router} | {batch:.2f} | {rate:.2f} |")
    (key_batch, key_rate), (default_batch, default_rate) = means["batch-key"], means["default"]
    print(
        f"\nbatch-key / default: mean batch {key_batch / default_batch:.2f}x, "
        f"throughput {key_rate / default_rate:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
