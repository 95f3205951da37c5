"""Rows of different sizes in one forward, packed end to end (FLUX:
`pipelines.stepping.packed_rows`) and padded to one grid (`pipelines.stepping.padded_grid`),
against one step group per size, and against one size at about the same token volume,
measured side by side in one run on the stepping stages themselves (`prepare`, `step`,
`finish` of the real adapter: no server, no queue), best of `--rounds`.

- **packed**: every request steps in one group: each step one forward over all rows laid
  end to end, one attention document each (only in a family that packs: `Family.packs_sizes`).
- **padded**: the same group, each step one forward over all rows padded to the largest
  size's token grid (`--mix-sizes pad`; not for SD3, which cannot pad).
- **per size**: one group per size (what the step key made of them before): each step one
  forward per size.
- **one size**: as many requests of the middle size as give about the same image tokens.

Each arm draws, steps and decodes `--per-size` requests of each of `--sizes` (px) for
`--steps` steps. The arms take turns each round (so load from other work on the machine falls
on all of them); printed per arm: its best wall seconds and process CPU seconds (all torch
threads), images/s and image tokens/s, and the first arm's throughput over the arm's; and the
attention backend (`--attention-backend`, as the server takes it). Flush-to-zero is on, as in
the server (`--flush-denormal`).

    python -m bench.mixed_sizes --model tiny-flux
    python -m bench.mixed_sizes --model shapes-dit
    python -m bench.mixed_sizes --model shapes-dit --attention-backend flex
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import torch

from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.denoiser.options import DenoiserConfig
from pipelines.registry import load_pipeline


@dataclass(frozen=True)
class Arm:
    name: str
    groups: list[list[GenerationRequest]]  # each group steps in its own forwards
    pack: bool = True  # where rows of several sizes share a forward: packed, else padded

    @property
    def images(self) -> int:
        return sum(r.params.n for group in self.groups for r in group)


def requests(pipeline: DiffusersAdapter, sides: list[int], steps: int, seed: int) -> list[GenerationRequest]:
    made = []
    for i, side in enumerate(sides):
        params = SamplingParams(width=side, height=side, num_inference_steps=steps, seed=seed + i)
        request = GenerationRequest.create(f"a large red circle on a blue background {i}", params)
        made.append(request.with_params(pipeline.resolve(request)))
    return made


def tokens(pipeline: DiffusersAdapter, group: list[GenerationRequest]) -> int:
    """Image tokens of a group's rows (not counting padding)."""
    total = 0
    for request in group:
        height, width = pipeline.family.token_grid(request)
        total += request.params.n * height * width
    return total


def run(pipeline: DiffusersAdapter, arm: Arm) -> tuple[float, float]:
    """(wall, process CPU) seconds to prepare, step to the end and decode every group of `arm`,
    one after another (the CPU runs each call to its end)."""
    family = pipeline.family
    family.config = replace(family.config, pack_sizes=arm.pack)
    wall, cpu = time.perf_counter(), time.process_time()
    for group in arm.groups:
        states = pipeline.prepare(group)
        while not all(state.is_done for state in states):
            pipeline.step(states)
        pipeline.finish(states)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 48, 64])
    parser.add_argument("--per-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention-backend", default="native")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    denoiser = DenoiserConfig(attention_backend=args.attention_backend)
    config = PipelineConfig(model=args.model, num_threads=args.threads, denoiser=denoiser)
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter)
    sides = [side for side in args.sizes for _ in range(args.per_size)]
    mixed = requests(pipeline, sides, args.steps, 0)
    assert len({pipeline.step_key(r) for r in mixed}) == 1, f"{args.model} does not mix sizes"
    per_size = [[r for r in mixed if r.params.width == side] for side in args.sizes]
    middle = sorted(args.sizes)[len(args.sizes) // 2]
    one = requests(pipeline, [middle], args.steps, 0)
    count = round(tokens(pipeline, mixed) / tokens(pipeline, one))
    packs = pipeline.family.packs_sizes_for(pipeline.task, mixed[0])
    arms = [
        *([Arm("packed (one group)", [mixed])] if packs else []),
        # SD3 cannot pad (`Family.pads_sizes`): its mixed groups always pack.
        *([Arm("padded (one group)", [mixed], pack=False)] if pipeline.family.pads_sizes else []),
        Arm("per size (a group each)", per_size),
        Arm(f"one size ({middle} px x {count})", [requests(pipeline, [middle] * count, args.steps, 0)]),
    ]
    for arm in arms:
        run(pipeline, arm)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {arm.name: [] for arm in arms}
    for _ in range(args.rounds):
        for arm in arms:
            times[arm.name].append(run(pipeline, arm))
    best = {name: min(wall for wall, _ in runs) for name, runs in times.items()}
    cpu = {name: min(used for _, used in runs) for name, runs in times.items()}
    padded = len(mixed) * max(h * w for h, w in map(pipeline.family.token_grid, mixed))
    print(
        f"{args.model}, sizes {args.sizes} px x {args.per_size} each, {args.steps} steps, "
        f"{torch.get_num_threads()} threads, attention backend {args.attention_backend}, best of "
        f"{args.rounds}; mixed: {tokens(pipeline, mixed)} image tokens a step, padded to {padded}"
    )
    print(
        f"| arm | forwards a step | image tokens | s | CPU s | images/s | tokens/s | {arms[0].name} ÷ arm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    mixed_rate = tokens(pipeline, mixed) / best[arms[0].name]
    for arm in arms:
        volume = sum(tokens(pipeline, group) for group in arm.groups)
        seconds = best[arm.name]
        print(
            f"| {arm.name} | {len(arm.groups)} | {volume} | {seconds:.2f} | {cpu[arm.name]:.2f} "
            f"| {arm.images / seconds:.1f} "
            f"| {volume / seconds:.0f} | {mixed_rate / (volume / seconds):.2f} |"
        )


if __name__ == "__main__":
    main()
