"""The front end's own capacity: images/s a server answers when its pipeline costs nothing,
so what is measured is HTTP, queueing, encoding, base64 and transfer alone.

The server serves `FrontEndImages` (`--pipeline-class bench.front_end:FrontEndImages`): each
forward sleeps `FORWARD_S` (2 ms, a batch of up to max_num_seqs) and returns the same
photo-like picture of the asked size (PNG keeps ~60% of its bytes, as photographs). C
closed-loop clients (default 32) send requests of one kind at a time: every size x format
(png, jpeg, webp) x answer (b64 JSON, url then a GET of the image, b64 streamed as events).
Every kind runs once per round on every contender, kinds and contenders rotating, so a noisy
machine hits them alike; the table gives the median images/s over rounds and each
contender's ratio to the first.

    python -m bench.front_end --rounds 3 --requests 64
    # before/after: another checkout's code, serving this file's pipeline (copied there)
    python -m bench.front_end --source before=/tmp/before --source after=.
    # this checkout with other flags: one API process against two
    python -m bench.front_end --variant "one=--api-server-count 1" --variant "two=--api-server-count 2"
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import ClassVar, Self

import httpx
import numpy as np

from bench.drivers import Outcome, closed_loop
from bench.launch import ROOT, ServerProcess, spawn_server, stop_server, wait_until_ready
from bench.workload import RequestSpec
from engine.request import BatchKey, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import Pipeline, PipelineConfig

FORWARD_S = 0.002  # one forward, whatever its batch: the pipeline's whole cost
PIPELINE = "bench.front_end:FrontEndImages"
ANSWERS = ("b64", "url", "stream")


@cache
def photo(width: int, height: int) -> np.ndarray:
    """A deterministic picture whose spectrum falls off as a photograph's (amplitude ~1/f^1.4,
    colour channels correlated, a little sensor noise): PNG keeps ~60% of its bytes."""
    rng = np.random.default_rng(0)
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    falloff = np.sqrt(fx**2 + fy**2) ** 1.4
    falloff[0, 0] = 1.0
    shape = falloff.shape
    shared = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    channels = []
    for _ in range(3):
        own = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        field = np.fft.irfft2((0.8 * shared + 0.2 * own) / falloff, s=(height, width))
        channels.append((field - field.mean()) / field.std())
    pixels = np.stack(channels, -1) * 40 + 128 + rng.normal(0, 1.2, (height, width, 3))
    image = np.clip(pixels, 0, 255).astype(np.uint8)
    image.flags.writeable = False  # one picture answers every request
    return image


class FrontEndImages(Pipeline):
    """A batch-capable pipeline whose forward takes FORWARD_S and answers `photo`."""

    supports_request_batch: ClassVar[bool] = True

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        return cls()

    def spec(self) -> FrontEndImages:
        return FrontEndImages()  # without the callbacks a worker process sets on itself

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        return replace(params, width=params.width or 1024, height=params.height or 1024)

    def validate(self, params: SamplingParams) -> None:
        pass

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        return (request.params.width, request.params.height)

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        time.sleep(FORWARD_S)
        outputs = []
        for request in batch.requests:
            image = photo(request.params.width or 1024, request.params.height or 1024)
            seeds = tuple(request.params.image_seeds())
            outputs.append(RequestOutput(request.request_id, images=tuple(image for _ in seeds), seeds=seeds))
        return outputs


@dataclass(frozen=True, slots=True)
class Kind:
    """What every request of one measurement asks for."""

    size: int
    output_format: str
    answer: str  # b64 | url | stream

    def label(self) -> str:
        return f"| {self.size}² | {self.output_format} | {self.answer} |"

    def body(self, seed: int) -> dict[str, object]:
        body: dict[str, object] = {"prompt": "a", "size": f"{self.size}x{self.size}", "seed": seed}
        body["output_format"] = self.output_format
        body["response_format"] = "url" if self.answer == "url" else "b64_json"
        body["stream"] = self.answer == "stream"
        return body


async def send(client: httpx.AsyncClient, kind: Kind, seed: int) -> Outcome:
    """One request, read to its last byte; a url answer's image fetched as a client would."""
    response = await client.post("/v1/images/generations", json=kind.body(seed))
    if response.status_code != 200:
        return Outcome(ok=False, error=f"HTTP {response.status_code}: {response.text[:200]}")
    if kind.answer == "url":
        for item in response.json()["data"]:
            image = await client.get(item["url"])
            if image.status_code != 200:
                return Outcome(ok=False, error=f"GET {item['url']}: HTTP {image.status_code}")
    elif kind.answer == "stream" and b".completed\n" not in response.content:
        return Outcome(ok=False, error="the stream ended without its image")
    return Outcome(ok=True, outputs=1)


async def measure(url: str, kind: Kind, requests: int, concurrency: int) -> float:
    """Images/s of `requests` requests of `kind` from `concurrency` closed-loop clients."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        specs = [RequestSpec("a", kind.size, kind.size, None, None, 1, seed) for seed in range(requests)]
        start = time.perf_counter()
        samples = await closed_loop(lambda spec: send(client, kind, spec.seed), specs, concurrency)
        wall = time.perf_counter() - start
    if failed := [s.error for s in samples if not s.ok]:
        raise RuntimeError(f"{len(failed)} requests of {kind} failed, the first: {failed[0]}")
    return sum(s.outputs for s in samples) / wall


def start(name: str, source: Path, workdir: Path, flags: list[str]) -> ServerProcess:
    """A server of `source`'s code (its checkout on PYTHONPATH) serving `FrontEndImages`."""
    (workdir / name).mkdir()
    args = ["front-end", "--pipeline-class", PIPELINE, "--max-queue-len", "100000", "--log-level", "warning"]
    env = {"PYTHONPATH": str(source.resolve())}
    return spawn_server(workdir / name, *args, *flags, config=None, env=env)


async def run(args: argparse.Namespace) -> None:
    kinds = [Kind(s, f, a) for s, f, a in itertools.product(args.sizes, args.formats, ANSWERS)]
    # Each contender: the code it runs and its own flags beside --server-args.
    sources = (item.partition("=")[::2] for item in args.source)
    variants = (item.partition("=")[::2] for item in args.variant)
    contenders = {name: (src, "") for name, src in sources}
    contenders |= {name: (str(ROOT), flags) for name, flags in variants}
    contenders = contenders or {"server": (str(ROOT), "")}
    rates: dict[tuple[str, Kind], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="diffbatch-front-end-") as workdir:
        servers = {
            name: start(name, Path(src), Path(workdir), [*args.server_args.split(), *flags.split()])
            for name, (src, flags) in contenders.items()
        }
        try:
            for server in servers.values():
                await asyncio.to_thread(wait_until_ready, server, 300)
            names = list(servers)
            for name in names:  # warm up: first connections, first encodes, the pool's threads
                await measure(servers[name].url, kinds[0], args.concurrency, args.concurrency)
            for r in range(args.rounds):
                for i, kind in enumerate(kinds[r:] + kinds[:r]):
                    turn = (r + i) % len(names)
                    for name in names[turn:] + names[:turn]:
                        rate = await measure(servers[name].url, kind, args.requests, args.concurrency)
                        rates.setdefault((name, kind), []).append(rate)
                        print(f"round {r + 1} {kind.label()} {name}: {rate:.1f} images/s", file=sys.stderr)
        finally:
            for server in servers.values():
                stop_server(server)
    print_table(list(contenders), kinds, rates)


def print_table(names: list[str], kinds: list[Kind], rates: dict[tuple[str, Kind], list[float]]) -> None:
    ratios = [f"{name} ÷ {names[0]}" for name in names[1:]]
    print("| size | format | answer | " + " | ".join([*(f"{n} images/s" for n in names), *ratios]) + " |")
    print("|---" * (3 + len(names) + len(ratios)) + "|")
    for kind in kinds:
        medians = [statistics.median(rates[(name, kind)]) for name in names]
        cells = [f"{m:.1f}" for m in medians] + [f"{m / medians[0]:.2f}" for m in medians[1:]]
        print(f"{kind.label()} " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.front_end",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--source", action="append", default=[], metavar="NAME=DIR", help="a contender served from DIR's code"
    )
    add(
        "--sizes",
        type=lambda t: [int(s) for s in t.split(",")],
        default=[1024, 512],
        help="default: 1024,512",
    )
    add(
        "--formats",
        type=lambda t: t.split(","),
        default=["png", "jpeg", "webp"],
        help="default: png,jpeg,webp",
    )
    add(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a contender served from this checkout with these flags too (e.g. two='--api-server-count 2')",
    )
    add("--concurrency", type=int, default=32, help="closed-loop clients (default: 32)")
    add("--requests", type=int, default=64, help="requests per kind per round (default: 64)")
    add("--rounds", type=int, default=3, help="default: 3")
    add("--server-args", default="", help="flags for every server (e.g. --executor process)")
    args = parser.parse_args(argv)
    print(f"# python -m bench.front_end {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, forward {FORWARD_S * 1000:.0f} ms\n")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
