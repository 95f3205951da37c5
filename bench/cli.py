"""`diffbatch bench` (or `python -m bench`): contenders side by side on one workload trace.

It starts the servers itself on loopback (or drives one at --url), loads the pipeline
in-process for `direct`, and runs every workload level round by round with the
contenders interleaved (their order rotating each round), so a noisy machine hits them
alike. It prints a markdown table per level and writes results.json and PNG plots.

    diffbatch bench --model tiny-qwen-image --steps 4 --workload closed:8,16
    diffbatch bench --workload "poisson:50%,80% steps=4,8,16,32" \
        --contender wait20="--request-batch-max-wait-ms 20"

Service levels (issue 30): a workload may mix request classes, each `class=NAME` followed
by its own options and `share=W` (its weight), and send `priority=` and `deadline=`
(seconds, or `2x` = twice the request's alone time, measured in the run) per request;
`tenants=K rates=10:1` sends each request with one of K API keys at those relative rates.
`--compare priority,fifo` drives each server with the trace as drawn and with every
priority 0 (same arrivals), and the report adds SLO attainment, latency per class,
priority and tenant, throughput per class and preemptions:

    diffbatch bench --contenders server --compare priority,fifo --workload "poisson:80% \
        class=interactive share=3 steps=4,8 priority=0 deadline=2x class=batch steps=32 priority=10"
    diffbatch bench --contenders server --compare fifo,alone:2 --workload "poisson:80% tenants=2 rates=10:1"
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.arms import with_arms
from bench.machine import VIDEO_MODALITIES, describe_machine, detect_modality
from bench.outputs import write_outputs
from bench.plan import Plan, start_contenders, stop_contenders
from bench.quality_pass import run_quality
from bench.runner import Runner
from bench.service_level_flags import add_service_level_flags, arms_of, tenant_entries
from bench.workload import Mix, parse_workload, with_option

BUILT_IN = {"direct": None, "server": "", "server-seq1": "--max-num-seqs 1"}
# Run in this process (`bench.direct`, `bench.raw_diffusers`), not started as servers.
LOCAL = ("direct", "direct-step", "diffusers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffbatch bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default="tiny-sd", help="what the servers serve and direct loads (default: tiny-sd)")
    add(
        "--workload",
        action="append",
        metavar="SPEC",
        help="KIND[:LEVELS] [key=values]: closed:8,16 | poisson:2.5,50%% | lone | burst:8 "
        "(repeatable; default closed:8). Keys size/steps/guidance/n/negative/partials/strength/model/"
        "priority/deadline override the mix; class=NAME share=W starts a class with its own keys; "
        "tenants=K rates=A:B spreads requests over K API keys",
    )
    add("--size", default="auto", help="comma list of WxH (or auto) drawn per request (default: auto)")
    add(
        "--steps",
        default="4",
        help="comma list of num_inference_steps drawn per request, or `default` for each server's own "
        "(default: 4)",
    )
    add("--guidance", default="default", help="comma list of guidance_scale (or default) drawn per request")
    add("--n", default="1", help="comma list of images per request drawn per request (default: 1)")
    add(
        "--negative",
        default="none",
        help="comma list of negative prompts drawn per request; none = without (default: none)",
    )
    add("--stream", action="store_true", help="ask for server-sent events (time to first byte)")
    add("--seconds", type=float, help="video length for video models (default: 1)")
    add("--requests", type=int, default=32, help="requests per round per level (default: 32)")
    add("--rounds", type=int, default=3, help="rounds per level; contenders alternate (default: 3)")
    add("--warmup", type=int, default=8, help="unmeasured requests per contender first (default: 8)")
    add("--threads", type=int, default=None, help="torch CPU threads per contender (default: all cores)")
    add("--device", default="cpu", help="torch device for direct and started servers (default: cpu)")
    add("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    add("--pipeline-class", help="module:Class serving the model, for direct and started servers")
    add(
        "--flush-denormal",
        choices=["on", "off"],
        default="on",
        help="subnormal floats flushed to zero in direct's pipeline thread and the started servers' "
        "(their --flush-denormal; default: on)",
    )
    add("--max-num-seqs", type=int, default=8, help="direct's batch size; match the servers' (default: 8)")
    add(
        "--contenders",
        help="built-in contenders to run, of direct, server, server-seq1, and in this process "
        "direct-step (the step-batching adapter) and diffusers (the pipeline's own batched call) "
        "(default: direct, server, server-seq1; none with --url)",
    )
    add(
        "--contender",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="another server, started with these extra `diffbatch serve` flags (repeatable)",
    )
    add("--server-args", default="", help="flags for every server this run starts (e.g. --device cuda)")
    add(
        "--url",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a server already running (Docker, another host); its name defaults to 'remote'",
    )
    add("--api-key", help="API key for --url servers")
    add("--modality", choices=["auto", "image", "edit", "video", "image-to-video"], default="auto")
    add("--capacity-concurrency", type=int, help="clients that measure capacity (default: 2 x max-num-seqs)")
    add(
        "--quality",
        action="store_true",
        help="also draw the held-out shapes prompts with every contender and report adherence per "
        "attribute, and PSNR/SSIM against a float32 full-steps reference (bench/quality_pass.py)",
    )
    add(
        "--quality-previews",
        action="store_true",
        help="--quality on each server's middle-step preview (partial_images=1) instead of its final "
        "picture, against the reference's final pictures: compare --preview-decoder linear and vae",
    )
    add("--quality-steps", type=int, help="steps of the --quality pictures (default: each contender's)")
    add("--reference-steps", type=int, help="steps of the --quality reference (default: the model's)")
    add("--seed", type=int, default=0, help="seed of the request trace (default: 0)")
    add_service_level_flags(parser)
    add("--out", type=Path, help="directory for results.json and plots (default: bench-results/DATE)")
    return parser


def parse_plan(args: argparse.Namespace, argv: list[str]) -> Plan:
    mix = Mix(stream=args.stream, seconds=args.seconds)
    for key in ("size", "steps", "guidance", "n", "negative"):
        mix = with_option(mix, key, getattr(args, key))
    workloads = [parse_workload(text, mix) for text in (args.workload or ["closed:8"])]
    # Against a server already running, start nothing unless asked.
    chosen = args.contenders if args.contenders is not None else ("" if args.url else ",".join(BUILT_IN))
    builtin = [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = [name for name in builtin if name not in BUILT_IN and name not in LOCAL]
    if unknown:
        raise ValueError(f"--contenders: unknown {unknown}; built-in ones are {[*BUILT_IN, *LOCAL[1:]]}")
    servers = [(name, BUILT_IN[name] or "") for name in builtin if name not in LOCAL]
    for item in args.contender:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            raise ValueError(f'--contender must look like NAME="FLAGS", got {item!r}')
        servers.append((name, flags))
    remotes = []
    for item in args.url:
        name, sep, url = item.partition("=") if "=" in item.split("://")[0] else ("remote", "=", item)
        remotes.append((name, url.rstrip("/")))
    local = tuple(name for name in LOCAL if name in builtin)
    names = [*local, *(name for name, _ in servers + remotes)]
    if not names:
        raise ValueError("nothing to measure: name --contenders, --contender or --url")
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must differ, got {names}")
    arms = arms_of(args)
    if arms and not servers + remotes:
        raise ValueError("--compare drives servers: name one (--contenders server, --contender or --url)")
    return Plan(
        arms=arms,
        tenant_keys=tenant_entries(args, workloads, remote=bool(remotes)),
        send_deadlines=args.send_deadlines,
        model=args.model,
        modality=args.modality,
        local=local,
        servers=dict(servers),
        remotes=dict(remotes),
        server_args=args.server_args,
        api_key=args.api_key,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        pipeline_class=args.pipeline_class,
        flush_denormal=args.flush_denormal == "on",
        max_num_seqs=args.max_num_seqs,
        workloads=workloads,
        command="diffbatch bench " + shlex.join(argv),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    missing = [name for name in ("matplotlib", "tqdm") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"diffbatch bench needs {', '.join(missing)}: pip install 'diffbatch[bench]'", file=sys.stderr)
        return 2
    try:
        plan = parse_plan(args, argv)
    except ValueError as exc:
        print(f"diffbatch bench: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run(plan, args, out))


async def run(plan: Plan, args: argparse.Namespace, out: Path) -> int:
    from tqdm import tqdm

    if plan.modality == "auto":
        plan.modality = detect_modality(plan.model, plan.pipeline_class)
    args.quality = args.quality or args.quality_previews
    if args.quality and plan.modality != "image":
        print(
            f"diffbatch bench: --quality scores pictures; {plan.model} is a {plan.modality} model",
            file=sys.stderr,
        )
        return 2
    if plan.modality in VIDEO_MODALITIES:  # a video's length is its size: one second unless asked
        plan.workloads = [replace(w, mix=w.mix.with_seconds(w.mix.seconds or 1.0)) for w in plan.workloads]
    meta = {
        **plan.describe(),
        **describe_machine(plan.threads),
        "rounds": args.rounds,
        "requests": args.requests,
    }
    if args.quality:  # None: each contender's default steps, and the model's for the reference
        meta |= {"quality_steps": args.quality_steps, "reference_steps": args.reference_steps}
        meta |= {"quality_previews": args.quality_previews}
    header = " ".join(f"{key}={value}" for key, value in meta.items() if key != "command")
    print(f"# {meta['command']}\n{header}\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="diffbatch-bench-") as workdir:
        started = await start_contenders(plan, Path(workdir))
        contenders = with_arms(started, plan.arms)
        total = len(contenders) * (
            args.warmup + sum(len(w.levels) * args.rounds * args.requests for w in plan.workloads)
        )
        quality = None
        try:
            with tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
                runner = Runner(contenders, args, bar)
                await runner.warm_up(plan.workloads[0].mix)
                results = [await runner.workload(i, w) for i, w in enumerate(plan.workloads)]
            if runner.alone:  # what deadline=Nx multiplied
                meta["alone_times_ms"] = runner.alone_times_ms()
            if args.quality:
                print("drawing the held-out prompts for --quality", file=sys.stderr, flush=True)
                quality = await run_quality(
                    plan,
                    started,
                    steps=args.quality_steps,
                    reference_steps=args.reference_steps,
                    out=out,
                    previews=args.quality_previews,
                )
        finally:
            await stop_contenders(started)
    write_outputs(results, meta, out, plan.unit, quality)
    return 0


if __name__ == "__main__":
    sys.exit(main())
