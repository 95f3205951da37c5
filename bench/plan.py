"""What one benchmark run compares, and starting and stopping its contenders."""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.arms import Arm
from bench.contenders import Contender, ServerContender
from bench.direct import DirectContender
from bench.launch import spawn_server, stop_server, wait_until_ready
from bench.machine import VIDEO_MODALITIES
from bench.raw_diffusers import DiffusersContender
from bench.service_level_flags import client_keys
from bench.workload import Workload


@dataclass
class Plan:
    """`servers`: name -> extra `diffbatch serve` flags for servers this run starts;
    `remotes`: name -> URL of servers already running."""

    model: str
    workloads: list[Workload]
    command: str
    modality: str = "auto"
    # The contenders run in this process, in order: of `direct`, `direct-step`, `diffusers`
    # (`bench.direct`, `bench.raw_diffusers`); they share one loaded pipeline.
    local: tuple[str, ...] = ("direct",)
    servers: dict[str, str] = field(default_factory=dict)
    remotes: dict[str, str] = field(default_factory=dict)
    server_args: str = ""
    api_key: str | None = None
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    pipeline_class: str | None = None
    max_num_seqs: int = 8
    # Subnormal floats flushed to zero in direct's thread and the started servers' (`--flush-denormal`).
    flush_denormal: bool = True
    # Service levels: arms each server is driven with, the tenants' `--api-key` entries
    # (given to the servers this run starts), and whether deadlines are sent as `timeout`.
    arms: tuple[Arm, ...] = ()
    tenant_keys: tuple[str, ...] = ()
    send_deadlines: bool = False

    @property
    def direct(self) -> bool:
        return "direct" in self.local

    @property
    def unit(self) -> str:
        return "videos" if self.modality in VIDEO_MODALITIES else "images"

    def describe(self) -> dict[str, object]:
        return {
            "command": self.command,
            "model": self.model,
            "modality": self.modality,
            "device": self.device,
            "dtype": self.dtype,
            "max_num_seqs": self.max_num_seqs,
            "contenders": [*self.local, *self.servers, *self.remotes],
            **({"arms": [arm.name for arm in self.arms]} if self.arms else {}),
            **({"tenants": len(self.tenant_keys)} if self.tenant_keys else {}),
        }

    def serve_args(self, flags: str) -> list[str]:
        """The `diffbatch serve` arguments of one started contender (its own flags last, so they win)."""
        common = [self.model, "--device", self.device, "--dtype", self.dtype, "--log-level", "warning"]
        # The benchmark brings its own load: nothing it sends should be refused for queue length.
        common += ["--max-queue-len", "100000"]
        if self.threads is not None:
            common += ["--num-threads", str(self.threads)]
        if self.pipeline_class:
            common += ["--pipeline-class", self.pipeline_class]
        if not self.flush_denormal:
            common += ["--flush-denormal", "off"]
        if self.tenant_keys:
            common += ["--api-key", ",".join(self.tenant_keys)]
        return [*common, *shlex.split(self.server_args), *shlex.split(flags)]


async def start_contenders(plan: Plan, workdir: Path) -> list[Contender]:
    """Spawn every server at once (they load while direct loads here), then wait for all."""
    processes = {}
    for name, flags in plan.servers.items():
        (workdir / name).mkdir()
        processes[name] = spawn_server(workdir / name, *plan.serve_args(flags), config=None)
    tenants = client_keys(plan.tenant_keys)
    # With tenants the servers ask for a key: the first one's serves warm-up, capacity, /metrics.
    keys: dict[str, Any] = {"tenant_keys": tenants, "send_deadlines": plan.send_deadlines}
    keys["api_key"] = tenants[0] if tenants else None
    contenders: list[Contender] = []
    try:
        if plan.local:
            contenders.extend(await asyncio.to_thread(load_local, plan))
        for name, process in processes.items():
            await asyncio.to_thread(wait_until_ready, process, 600)
            contenders.append(
                ServerContender(name, process.url, plan.modality, plan.servers[name], process=process, **keys)
            )
    except BaseException:
        for process in processes.values():
            stop_server(process)
        raise
    for name, url in plan.remotes.items():
        remote_keys = {**keys, "api_key": plan.api_key or keys["api_key"]}
        contenders.append(ServerContender(name, url, plan.modality, **remote_keys))
    return contenders


async def stop_contenders(contenders: list[Contender]) -> None:
    for contender in contenders:
        if isinstance(contender, ServerContender):
            await contender.close()
            if contender.process is not None:
                await asyncio.to_thread(stop_server, contender.process)


def load_local(plan: Plan) -> list[Contender]:
    """The plan's in-process contenders, over one pipeline loaded here."""
    direct = load_direct(plan)
    pipeline, seqs, flush = direct.pipeline, plan.max_num_seqs, plan.flush_denormal
    made: dict[str, Contender] = {
        "direct": direct,
        "direct-step": DirectContender(pipeline, seqs, "direct-step", flush_denormal=flush, batching="step"),
    }
    if "diffusers" in plan.local:  # it refuses what it cannot call
        made["diffusers"] = DiffusersContender(pipeline, seqs, flush_denormal=flush)
    if "direct-step" in plan.local and not direct.pipeline.supports_step_batch:
        raise ValueError(f"direct-step: {plan.model} is not served step-level")
    return [made[name] for name in plan.local]


def load_direct(plan: Plan, *, name: str = "direct", dtype: str | None = None) -> DirectContender:
    """The plan's model loaded in this process (in `dtype` rather than the plan's, if given)."""
    from diffusers.utils import logging as diffusers_logging

    from pipelines.base import PipelineConfig
    from pipelines.registry import load_pipeline

    # diffusers warns on every call about settings the trace chose on purpose (true CFG
    # without a negative prompt); in a benchmark's output that is noise.
    diffusers_logging.set_verbosity_error()
    config = PipelineConfig(
        model=plan.model,
        device=plan.device,
        dtype=dtype or plan.dtype,
        num_threads=plan.threads,
        pipeline_class=plan.pipeline_class,
        flush_denormal=plan.flush_denormal,
    )
    return DirectContender(load_pipeline(config), plan.max_num_seqs, name, flush_denormal=plan.flush_denormal)
