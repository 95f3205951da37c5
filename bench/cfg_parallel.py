"""The latency of ONE request on a lane of two workers of one thread each sharing every step
— its guided rows (`--cfg-parallel 2`, a guided request) or its tokens (`--lane sequence`:
`--sequence-parallel 2`, Ulysses; `--lane ring`: `--sp-mode ring`) — against one worker of
one thread and one worker of two threads. Real servers (`bench.launch`), one request at a
time, in interleaved rounds so that other work on the machine falls on all alike; the median
of each, and the ratios. `--lane` again adds another lane to the same rounds.

    python -m bench.cfg_parallel [--model tiny-sd] [--size 256] [--steps 8] [--rounds 5]
    python -m bench.cfg_parallel --lane sequence [--model tiny-flux] [--size 256]
    python -m bench.cfg_parallel --lane sequence --lane ring --size 512

On a GPU the same comparison is two devices against one (`--device cuda`): not run here
(`bench/gpu_check.sh` has it prepared).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import openai

from bench.launch import ServerProcess, spawn_server, stop_server, wait_until_ready

# (label, serve arguments): each contender's workers and threads.
BASELINES = [
    ("1 worker x 1 thread", ("--num-threads", "1", "--executor", "process")),
    ("1 worker x 2 threads", ("--num-threads", "2", "--executor", "process")),
]
# The lane of each kind: its contender, the model it runs by default, the request's guidance.
LANES = {
    "cfg": (
        ("cfg-parallel: 2 workers x 1 thread", ("--num-threads", "2", "--cfg-parallel", "2")),
        "tiny-sd",
        7.5,
    ),
    "sequence": (
        (
            "sequence-parallel (Ulysses): 2 workers x 1 thread",
            ("--num-threads", "2", "--sequence-parallel", "2"),
        ),
        "tiny-flux",
        3.5,  # FLUX's distilled guidance: one row per image, nothing for --cfg-parallel
    ),
    "ring": (
        (
            "sequence-parallel (ring): 2 workers x 1 thread",
            ("--num-threads", "2", "--sequence-parallel", "2", "--sp-mode", "ring"),
        ),
        "tiny-flux",
        3.5,
    ),
}


def one_request(server: ServerProcess, size: int, steps: int, seed: int, guidance: float) -> float:
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600) as client:
        started = time.perf_counter()
        client.images.generate(
            prompt="a red circle on a blue background",
            size=f"{size}x{size}",
            extra_body={"seed": seed, "num_inference_steps": steps, "guidance_scale": guidance},
        )
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lane", choices=sorted(LANES), action="append", help="default: cfg")
    parser.add_argument("--model", default=None, help="default: tiny-sd (cfg), tiny-flux (sequence, ring)")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    chosen = [LANES[name] for name in args.lane or ["cfg"]]
    _, default_model, guidance = chosen[0]
    model = args.model or default_model
    contenders = [*BASELINES, *(lane for lane, _, _ in chosen)]
    workdir = Path(tempfile.mkdtemp(prefix="diffbatch-cfg-parallel-"))
    common = (model, "--deadline-admission", "off")
    servers = []
    try:
        for index, (_, flags) in enumerate(contenders):
            own = workdir / str(index)
            own.mkdir()
            servers.append(spawn_server(own, *common, *flags, config=None))
        for server in servers:
            wait_until_ready(server, 300)
        for server in servers:  # a warm-up request each: first-call costs are not latency
            one_request(server, args.size, args.steps, 0, guidance)
        times: list[list[float]] = [[] for _ in servers]
        for round_ in range(args.rounds):
            for index, server in enumerate(servers):
                times[index].append(one_request(server, args.size, args.steps, round_ + 1, guidance))
    finally:
        for server in servers:
            stop_server(server)
    medians = [statistics.median(each) for each in times]
    print(
        f"one request, {model} {args.size}x{args.size}, {args.steps} steps, guidance {guidance}, "
        f"{args.rounds} rounds"
    )
    print("| contender | median s | vs 1 x 1 | vs 1 x 2 |")
    print("|---|---:|---:|---:|")
    for (label, _), median in zip(contenders, medians, strict=True):
        print(f"| {label} | {median:.3f} | {medians[0] / median:.2f}x | {medians[1] / median:.2f}x |")


if __name__ == "__main__":
    main()
