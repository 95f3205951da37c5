"""Fair share between API keys, measured side by side in one run: a light key's latency
alone, beside a heavy key sending 10x its rate (fair share), and the same arrivals sent
with one key (served oldest-first, as without fair share).

The server serves a fake pipeline whose work takes a fixed time (`tests.pipelines.fixed_time`),
so the figures show the scheduling policy rather than how busy the machine is. The heavy
key sends at the server's measured capacity, the light one a tenth of that: 1.1x in all,
so without fair share a backlog grows and the light key waits behind it.

    python -m bench.fair_share --batching step --seconds 60 [--scale 5] [--max-num-seqs 4]
        [--compare-preemption]

`--compare-preemption` runs the fair-share phase once more on a second server with
`--preemption off` (in step mode, a light request then waits for a heavy one of its priority
to finish instead of pausing it); `--no-one-key` skips the one-key phase.

`--scale` makes every forward and step that many times slower (capacity as many times
lower), so fewer requests a second pass through the host's HTTP handling, whose own delays
on a busy machine would otherwise sit in the tail.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.launch import ROOT, ServerProcess, start_server, stop_server

BODY = {"size": "32x32", "num_inference_steps": 4, "seed": 1}
PIPELINES = {"request": "FixedTimeImages", "step": "FixedTimeSteps"}
Sample = tuple[str, float, int]  # (stream, seconds, status)


async def _send(client: httpx.AsyncClient, url: str, key: str, tag: str, out: list[Sample]) -> None:
    start = time.monotonic()
    try:
        response = await client.post(
            url, json={"prompt": tag, **BODY}, headers={"Authorization": f"Bearer {key}"}
        )
    except httpx.TransportError:
        # A kept-alive connection the server closed as it was reused: counted, not fatal.
        out.append((tag, time.monotonic() - start, 0))
        return
    out.append((tag, time.monotonic() - start, response.status_code))


async def _phase(url: str, streams: list[tuple[str, str, float]], seconds: float) -> list[Sample]:
    """Each (key, tag, rate) stream sends Poisson arrivals for `seconds`; every answer awaited."""
    out: list[Sample] = []
    sent: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def stream(key: str, tag: str, rate: float, seed: int) -> None:
            rng, end = random.Random(seed), time.monotonic() + seconds
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.monotonic() >= end:
                    return
                sent.append(asyncio.create_task(_send(client, url, key, tag, out)))

        await asyncio.gather(*(stream(key, tag, rate, i) for i, (key, tag, rate) in enumerate(streams)))
        await asyncio.gather(*sent)
    return out


async def _capacity(url: str, seconds: float, clients: int) -> float:
    """Requests a second a closed loop of `clients` clients gets."""
    done, end = 0, time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=600) as client:

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                body = {"prompt": "c", **BODY}
                response = await client.post(url, json=body, headers={"Authorization": "Bearer heavy"})
                done += response.status_code == 200

        await asyncio.gather(*(loop() for _ in range(clients)))
    return done / seconds


def _preemptions(server: ServerProcess) -> float:
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer heavy"}).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("diffbatch_preemptions_total")
    )


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _latencies(samples: list[Sample], tag: str) -> list[float]:
    return [seconds for t, seconds, status in samples if t == tag and status == 200]


def _serve(batching: str, scale: float, workdir: Path, seats: int, *flags: str) -> ServerProcess:
    return start_server(
        workdir,
        *("--api-key", "heavy,light", "--max-queue-len", "100000", "--max-num-seqs", str(seats)),
        *("--pipeline-class", f"tests.pipelines.fixed_time:{PIPELINES[batching]}"),
        *("--batching", batching, "--request-batch-max-wait-ms", "0", *flags),
        env={"PYTHONPATH": str(ROOT), "DIFFBATCH_FIXED_TIME_SCALE": str(scale)},
    )


async def _preemption_off(
    batching: str, seconds: float, scale: float, workdir: Path, *, capacity: float, seats: int
) -> list[Sample]:
    """The fair-share phase again, on a server with `--preemption off` (same rates)."""
    server = _serve(batching, scale, workdir / "off", seats, "--preemption", "off")
    url = f"{server.v1}/images/generations"
    try:
        await _capacity(url, 5, 4 * seats)  # warm-up
        return await _phase(url, [("heavy", "heavy", capacity), ("light", "light", capacity / 10)], seconds)
    finally:
        stop_server(server)


async def run(
    batching: str,
    seconds: float,
    scale: float,
    workdir: Path,
    *,
    compare_preemption: bool,
    one_key: bool,
    seats: int = 8,
) -> None:
    server = _serve(batching, scale, workdir, seats)
    url = f"{server.v1}/images/generations"
    try:
        await _capacity(url, 5, 4 * seats)  # warm-up
        capacity = await _capacity(url, 20, 4 * seats)
        light = capacity / 10
        print(
            f"{batching} batching: capacity {capacity:.2f} req/s; "
            f"light sends {light:.2f}/s, heavy {capacity:.2f}/s"
        )
        phases = {
            "alone": await _phase(url, [("light", "light", light)], seconds),
            "fair share": await _phase(
                url, [("heavy", "heavy", capacity), ("light", "light", light)], seconds
            ),
        }
        print(f"pauses (diffbatch_preemptions_total) after the fair-share phase: {_preemptions(server):.0f}")
        if one_key:
            phases["one key"] = await _phase(
                url, [("heavy", "heavy", capacity), ("heavy", "light", light)], seconds
            )
    finally:
        stop_server(server)
    if compare_preemption:
        (workdir / "off").mkdir()
        phases["fair share, preemption off"] = await _preemption_off(
            batching, seconds, scale, workdir, capacity=capacity, seats=seats
        )
    failed = {name: sum(status != 200 for _, _, status in samples) for name, samples in phases.items()}
    print(f"not answered 200 (each phase): {failed}")
    alone = _p99(_latencies(phases["alone"], "light"))
    print("| phase | stream | answered | p50 s | p99 s | light p99 / alone |")
    print("|---|---|---:|---:|---:|---:|")
    for name, samples in phases.items():
        for tag in ("light", "heavy"):
            values = _latencies(samples, tag)
            if values:
                ratio = f"{_p99(values) / alone:.2f}" if tag == "light" else ""
                print(
                    f"| {name} | {tag} | {len(values)} | {statistics.median(values):.3f} "
                    f"| {_p99(values):.3f} | {ratio} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batching", choices=tuple(PIPELINES), default="step")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--scale", type=float, default=1.0, help="how many times slower the fake work")
    parser.add_argument(
        "--compare-preemption",
        action="store_true",
        help="run the fair-share phase again on a server with --preemption off",
    )
    parser.add_argument("--no-one-key", action="store_true", help="skip the one-key phase")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="the servers' seats, the server's own default (capacity measured with 4x as many clients)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        asyncio.run(
            run(
                args.batching,
                args.seconds,
                args.scale,
                Path(workdir),
                compare_preemption=args.compare_preemption,
                one_key=not args.no_one_key,
                seats=args.max_num_seqs,
            )
        )


if __name__ == "__main__":
    main()
