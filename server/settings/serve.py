"""Every serving setting in one validated model, shared by YAML presets, `DIFFBATCH_*`
variables and CLI flags: `ServeSettings` inherits each group of settings (a `Section`,
`section.py`), and joins them (the settings of each of several models, the pipeline's and
the engine's configs) with the checks across them.

Each field's description is also its `--flag` help text, so the two never drift apart.
Where values come from, and in which order: `server/settings/sources.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

from pydantic import Field, model_validator

from engine.core.config import EngineConfig
from engine.logs import LogFormat
from pipelines.base import PipelineConfig
from pipelines.denoiser.options import ATTENTION_BACKENDS, parse_attention_backend
from pipelines.parallel.seat import lane_seats
from server.settings.acceleration import CacheSettings, DenoiserSettings
from server.settings.batching import BatchingSettings, SchedulingSettings
from server.settings.http import HttpSettings, RequestSettings
from server.settings.memory import MemorySettings
from server.settings.model import FamilySettings, ModelSettings
from server.settings.model_set import ModelEntry, ModelSetSettings
from server.settings.moderation import ModerationSettings
from server.settings.ray_placement import RayStartSettings, ReplicaPlacementSettings
from server.settings.section import MODEL_SECTION, Section
from server.settings.storage import JobSettings, OutputSettings
from server.settings.traces import TraceSettings
from server.settings.webhooks import WebhookSettings
from server.settings.workers import GatewaySettings, RayServeSettings, WorkerSettings


class ProcessSettings(Section):
    """How the server process logs and shuts down."""

    help_section = MODEL_SECTION
    each_model = False

    shutdown_timeout_s: int = Field(
        30,
        ge=1,
        description="on SIGTERM, how long requests in flight may finish before they are cut off "
        "and the running forward is interrupted",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")
    log_format: LogFormat = Field(
        "text",
        description="log lines as text, or as one JSON object per line (timestamp, level, logger, "
        "message, and the request id, model, tenant digest and event where known; uvicorn's lines "
        "and whatever else reaches stderr or stdout too)",
    )


class ServeSettings(
    # `--help` lists the groups' flags in the order pydantic lists the fields: the last base's
    # first. So the bases run from the end of `--help` back to its start, and a section's
    # place is that of its first group.
    RayStartSettings,
    ReplicaPlacementSettings,
    GatewaySettings,
    TraceSettings,
    ModerationSettings,
    WebhookSettings,
    OutputSettings,
    DenoiserSettings,
    ModelSetSettings,
    MemorySettings,
    JobSettings,
    HttpSettings,
    ProcessSettings,
    RequestSettings,
    CacheSettings,
    FamilySettings,
    SchedulingSettings,
    RayServeSettings,
    WorkerSettings,
    BatchingSettings,
    ModelSettings,
):
    """Every setting, inherited by group (each a `Section`: its `--help` section, and whether
    one of several models may set it). What is here: what joins them and checks across them."""

    @classmethod
    def sections(cls) -> list[type[Section]]:
        """The groups of settings, in the order of their fields (the order of `--help`)."""
        groups = reversed(cls.__mro__[1:])
        return [group for group in groups if issubclass(group, Section) and group is not Section]

    @model_validator(mode="after")
    def _overlap_without_moving_components(self) -> ServeSettings:
        # Model and sequential offload move whole components (or layers) between devices in
        # accelerate's hooks on each call: a decode on its own thread would offload the
        # denoiser mid-step, and the step's hook the VAE mid-decode. Group offload moves each
        # component's own blocks only, so it decodes beside the steps safely.
        if self.decode_overlap != "off" and self.offload in ("model", "sequential"):
            raise ValueError(
                f"--decode-overlap {self.decode_overlap} cannot go with --offload {self.offload} "
                "(its hooks move whole components between devices, so a decode beside the steps "
                "would move the denoiser mid-step): use --decode-overlap off, or --offload group"
            )
        return self

    @model_validator(mode="after")
    def _api_servers_on_one_machine(self) -> ServeSettings:
        if self.api_server_count > 1 and self.ray_address is not None:
            raise ValueError(
                "--api-server-count is for a server on one machine; on Ray Serve scale the "
                "gateway with --gateway-replicas instead"
            )
        return self

    @model_validator(mode="after")
    def _adapters_named_apart(self) -> ServeSettings:
        if self.model_name in self.lora_modules:
            raise ValueError(
                f"lora_modules: {self.model_name!r} is the base model's name; name the adapter apart"
            )
        return self

    @model_validator(mode="after")
    def _ip_adapters_step(self) -> ServeSettings:
        # A reference image's attention is added per row at its own scale in a shared step
        # (`pipelines.ip_adapter`); diffusers' call takes one scale per pipeline.
        if self.ip_adapter and self.batching == "request":
            raise ValueError(
                "--ip-adapter needs --batching step (reference images are added per row in a step)"
            )
        return self

    @model_validator(mode="after")
    def _lanes_step(self) -> ServeSettings:
        # The members share each step's forward (`pipelines.parallel`): a request-level
        # diffusers call has no step to share. Step caches decide per request over all its
        # rows and tokens, whichever members hold them (`pipelines.parallel.lane_split`); a
        # family whose tokens cannot be cached while split is refused at its start.
        shape = self.lane_shape
        if shape.size == 1:
            return self
        flags = shape.flags()
        if self.batching == "request":
            raise ValueError(f"{flags} needs --batching step: the devices share each step")
        # On Ray Serve a replica of such lanes is a placement group of one bundle per worker
        # (`server/ray_serve/placement.py`): one whole GPU each, or CPUs on the CPU.
        if self.replica_gpus is not None:
            raise ValueError(
                f"{flags} on Ray Serve asks one GPU per worker (a placement group bundle each): "
                "leave --replica-gpus out"
            )
        if self.replica_cpus == 0 and "cpu" in self.worker_devices():
            raise ValueError(
                f"{flags} on Ray Serve with --device cpu asks --replica-cpus per worker (a "
                "placement group bundle each, which cannot be empty): give at least a fraction"
            )
        # A reference image's tokens are not split with the rows yet; a ControlNet's rows split
        # with the guided rows where the family says so (`lane_group.refusal`, at load), its
        # tokens not at all.
        if self.ip_adapter or (self.controlnet and shape.sequence > 1):
            flag = "--ip-adapter" if self.ip_adapter else "--controlnet"
            raise ValueError(f"{flags} cannot go with {flag} (not split across the devices yet)")
        return self

    @model_validator(mode="after")
    def _tokens_split(self) -> ServeSettings:
        # diffusers' context parallelism runs through the attention dispatcher's backends that
        # say so (`AttentionBackend.sequence_modes_on`: ring on the CPU with diffbatch's op that
        # returns the log-sum-exp).
        shape = self.lane_shape
        if shape.sequence == 1:
            return self
        flags = f"--sequence-parallel {shape.sequence} --sp-mode {shape.mode}"
        cpu = "cpu" in self.worker_devices()
        backend = parse_attention_backend(self.attention_backend)
        if shape.mode not in backend.sequence_modes_on(cpu):
            able = [
                name
                for name, b in ATTENTION_BACKENDS.items()
                if shape.mode in b.sequence_modes_on(cpu) and not (cpu and b.cuda_only)
            ]
            raise ValueError(
                f"{flags} cannot go with --attention-backend {self.attention_backend}: diffusers "
                f"0.42.1 runs {shape.mode} attention with {', '.join(able)}" + (" on the CPU" if cpu else "")
            )
        return self

    def worker_configs(self) -> list[PipelineConfig]:
        """One pipeline config per worker: its own device and, on CPU, its share of the
        threads (so N workers do not each start a thread per core)."""
        base = self.pipeline_config()
        workers = self.data_parallel_size * self.lane_shape.size
        threads = self.num_threads
        if workers > 1 and self.device.strip() == "cpu":
            threads = max(1, (threads or os.cpu_count() or 1) // workers)
        return [replace(base, device=device, num_threads=threads) for device in self.worker_devices()]

    def lane_configs(self) -> list[list[PipelineConfig]]:
        """The workers' configs lane by lane: one each, or with `cfg_parallel` or
        `sequence_parallel` a lane's members, each with its seat in the lane (rank 0 first: it
        leads)."""
        configs, shape = self.worker_configs(), self.lane_shape
        lanes = [configs[start : start + shape.size] for start in range(0, len(configs), shape.size)]
        if shape.size == 1:
            return lanes
        return [
            [replace(config, lane=seat) for config, seat in zip(lane, lane_seats(shape), strict=True)]
            for lane in lanes
        ]

    @property
    def model_name(self) -> str:
        """The default model's id (the first of several)."""
        return self.models[0].name if self.models else self.served_model_name or self.model

    def for_entry(self, entry: ModelEntry) -> ServeSettings:
        """The settings one of several models runs with: these, with its own over them."""
        own = entry.own_settings()
        if wide := sorted(set(own) - _PER_MODEL):
            raise ValueError(
                f"model {entry.name!r}: {', '.join(wide)} cannot differ between models (set "
                "it once for the server); a model takes model, batching, worker and memory settings"
            )
        values = self.model_dump(exclude=set(ModelSetSettings.model_fields), exclude_unset=True)
        values.update(own, model=entry.model, served_model_name=entry.name)
        # The key file was read into api_key already; handing both on would be refused.
        values.pop("api_key_file", None)
        return ServeSettings(**values)

    def per_model(self) -> list[ServeSettings]:
        """The settings of each served model: one per `models` entry, or these."""
        return [self.for_entry(entry) for entry in self.models] or [self]

    def models_budget_bytes(self, device_total: Callable[[str], int | None] | None = None) -> int | None:
        """The bytes of weights the loaded models may hold: `--models-memory-mb`; else, when
        `--gpu-memory-utilization` is given and the models' device is a CUDA device here, that
        share of its memory; else no limit (the CPU's memory is the host's: nothing to size it by)."""
        if self.models_memory_mb is not None:
            return int(self.models_memory_mb * 2**20)
        if "gpu_memory_utilization" not in self.model_fields_set:
            return None
        if device_total is None:
            from pipelines.memory.gauge import device_total_bytes  # torch, only when asked

            device_total = device_total_bytes
        total = device_total(self.device.split(",")[0].strip())
        return None if total is None else int(total * self.gpu_memory_utilization)

    @model_validator(mode="after")
    def _models_build(self) -> ServeSettings:
        # Every model's own settings are checked at start, not when it first loads.
        names = [entry.name for entry in self.models]
        for entry in self.models:
            own = self.for_entry(entry)
            names += [*own.lora_modules, *own.controlnet, *own.ip_adapter]
        if not self.models:  # one model: its adapters, ControlNets and IP-Adapters all the same
            names = [self.model_name, *self.lora_modules, *self.controlnet, *self.ip_adapter]
        # A request's `model` names a model or an adapter: each must name one thing.
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"models: {', '.join(repeated)} names more than one model or adapter")
        return self

    def pipeline_config(self) -> PipelineConfig:
        return PipelineConfig(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            pipeline_class=self.pipeline_class,
            default_size=self.default_size_pair(),
            default_steps=self.default_steps,
            default_guidance_scale=self.default_guidance_scale,
            default_guidance_scale_2=self.default_guidance_scale_2,
            default_true_cfg_scale=self.default_true_cfg_scale,
            default_negative_prompt=self.default_negative_prompt,
            size_multiple=self.size_multiple,
            scheduler=self.scheduler,
            timesteps=tuple(self.timesteps),
            max_pixels=self.max_pixels,
            num_threads=self.num_threads,
            flush_denormal=self.flush_denormal == "on",
            preview_decoder=self.preview_decoder,
            max_request_work=self.max_request_work,
            lora_modules=tuple(self.lora_modules.items()),
            max_loras=self.max_loras,
            controlnets=tuple(self.controlnet.items()),
            ip_adapters=tuple(self.ip_adapter.items()),
            memory=self.memory_config(),
            options=self.family_options(),
            prompt_cache_mb=self.prompt_cache_mb,
            cache=self.cache_choice(),
            cache_threshold=self.cache_threshold,
            denoiser=self.denoiser_config(),
            safety_checker=self.safety_checker,
            mix_sizes=self.mix_sizes != "off",
            pack_sizes=self.mix_sizes == "on",
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_num_seqs=self.max_num_seqs,
            request_batch_max_wait_ms=self.request_batch_max_wait_ms,
            max_queue_len=self.max_queue_len,
            batching=self.batching,
            max_step_tokens=self.max_step_tokens,
            max_input_bytes=int(self.max_queued_input_mb * 2**20),
            retry_on_worker_crash=self.retry_on_worker_crash,
            max_loras=self.max_loras,
            priority_aging_s=self.priority_aging_s,
            deadline_admission=self.deadline_admission == "on",
            preemption=self.preempts,
            deadline_groups=self.deadline_groups == "on",
        )


# What one of several models may set for itself: the settings of the groups that say so
# (its own, batching, workers, memory); HTTP, jobs, outputs, webhooks and Ray are the server's.
_PER_MODEL = frozenset(
    name for group in ServeSettings.sections() if group.each_model for name in group.model_fields
)
