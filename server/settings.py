"""Every serving setting in one validated model, shared by YAML presets and CLI flags.

Each field's description is also its `--flag` help text, so the two never drift apart.
Where values come from, and in which order: `server/settings_sources.py`.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import replace
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from engine.config import EngineConfig
from pipelines.base import PipelineConfig
from pipelines.trained.shipped import DEFAULT_MODEL
from server.acceleration_settings import AccelerationSettings
from server.cache_settings import CacheSettings
from server.deadline_group_settings import DeadlineGroupSettings
from server.deadline_settings import DeadlineSettings
from server.denoiser_settings import DenoiserSettings
from server.family_settings import FamilySettings
from server.gateway_settings import GatewaySettings
from server.http_settings import HttpSettings
from server.job_settings import JobSettings
from server.memory_settings import MemorySettings
from server.model_set_settings import ModelEntry, ModelSetSettings
from server.output_settings import OutputSettings
from server.preemption_settings import PreemptionSettings
from server.priority_settings import PrioritySettings
from server.residency_settings import ResidencySettings
from server.switches import AutoSwitch
from server.webhook_settings import WebhookSettings

_SIZE = re.compile(r"^(\d+)x(\d+)$")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ServeSettings(
    AccelerationSettings,
    CacheSettings,
    DeadlineSettings,
    DenoiserSettings,
    FamilySettings,
    HttpSettings,
    JobSettings,
    MemorySettings,
    ModelSetSettings,
    OutputSettings,
    ResidencySettings,
    PrioritySettings,
    PreemptionSettings,
    DeadlineGroupSettings,
    WebhookSettings,
    GatewaySettings,
):
    """Every setting; besides the model, batching and workers here, how the server meets
    HTTP is inherited from `HttpSettings`, where jobs are kept from `JobSettings`, the memory
    ones (dtypes per component, offload, quantization, decode budget) from
    `MemorySettings`, several models from `ModelSetSettings`, where outputs go from
    `OutputSettings`, webhooks from `WebhookSettings`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        DEFAULT_MODEL,
        description="a shipped trained model (shapes, shapes-dit), a built-in tiny-* model, "
        "a local diffusers directory, or a hub id",
    )
    served_model_name: str | None = Field(
        None, description="the model id clients send and /v1/models lists (default: MODEL)"
    )
    max_num_seqs: int = Field(8, ge=1, description="most images in one batched forward")
    request_batch_max_wait_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="how long an idle engine may wait for compatible requests (0 = never)",
    )
    max_queue_len: int = Field(1024, ge=1, description="most waiting requests; more get 429")
    max_queued_input_mb: float = Field(
        1024.0,
        gt=0,
        allow_inf_nan=False,
        description="most MiB of input images (edits, image-to-video) held by requests in progress; "
        "more get 429 (each image counts as stored: reduced to what the model uses)",
    )
    batching: Literal["request", "step"] = Field(
        "step",
        description="step: requests join and leave between denoising steps, each with its own "
        "steps, guidance and negative prompt (pipelines that cannot step fall back to request); "
        "request: same-key requests run as one batch to its end",
    )
    max_step_tokens: int | None = Field(
        None,
        ge=1,
        description="step mode: most rows x latent tokens stepping at once, so a large image or "
        "a video takes the share of several small images (default: max-num-seqs requests of the "
        "model's default size)",
    )
    executor: Literal["auto", "thread", "process"] = Field(
        "auto",
        description="where the pipeline runs: thread (a thread of the server process) or process "
        "(a worker process: results through shared memory, restarted if it dies); auto: thread "
        "with one worker, process with --data-parallel-size above 1",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="worker processes, each with its own copy of the pipeline on its own device "
        "(--device cuda gives cuda:0..N-1, or list them: cuda:0,cuda:2; on cpu --num-threads is "
        "split between them); their batches run in parallel",
    )
    ray_address: str | None = Field(
        None,
        description="serve through Ray Serve on this cluster (auto, or host:port of its head) "
        "instead of in this process: a gateway with these routes in front of --replicas engine "
        "replicas (needs the [ray] extra)",
    )
    replicas: int = Field(1, ge=1, description="Ray Serve: engine replicas, one device each")
    max_replicas: int | None = Field(
        None,
        ge=1,
        description="Ray Serve: autoscale between --replicas and this many replicas on "
        "ongoing requests (target: max-num-seqs per replica)",
    )
    ray_router: Literal["batch-key", "default"] = Field(
        "batch-key",
        description="Ray Serve: batch-key (requests that can share forwards go to the same "
        "replica while it has room) or default (Ray's power of two choices)",
    )
    retry_on_worker_crash: bool = Field(
        False,
        description="a request whose worker process died, or whose result from it could not be "
        "read, runs once more (on another worker if there is one) instead of failing with 503 "
        "worker_restarting (500)",
    )
    worker_start_timeout_s: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a worker process may take to load the model (at start and after a "
        "restart) before it is killed: the start fails, or the restart is tried again; the log "
        "says what it loads while it loads",
    )
    decode_overlap: AutoSwitch = Field(
        "off",
        description="step mode: decode finished requests on a second thread while the others go "
        "on stepping: on, off, or auto (when a decode is measured to cost more than a step); "
        "it shares the host's cores, so measure it with diffbatch bench before turning it on; "
        "not with --offload model or sequential",
    )
    preview_decoder: Literal["vae", "linear"] = Field(
        "linear",
        description="how partial_images previews are decoded in step mode: linear (a latent-to-RGB "
        "map fitted on the server's own final images: next to free, one colour per latent pixel; "
        "the VAE until 4 images are done, and always for models with a safety checker) or vae "
        "(the model's VAE: true previews, each as costly as a final decode)",
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, allow_inf_nan=False, description="per-request deadline in seconds; past it: 504"
    )
    shutdown_timeout_s: int = Field(
        30,
        ge=1,
        description="on SIGTERM, how long requests in flight may finish before they are cut off "
        "and the running forward is interrupted",
    )
    video_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="deadline of a video job from its creation, in seconds; past it the job fails "
        "with code timeout and leaves the engine at the next step (step mode) or batch",
    )
    device: str = Field(
        "cpu",
        description="torch device for the pipeline: cpu, cuda, cuda:1, ...; with data parallelism "
        "a comma-separated list, one per worker",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights dtype; auto = bfloat16 on GPU, float32 on CPU"
    )
    pipeline_class: str | None = Field(
        None, description="module:Class of a custom pipelines.base.Pipeline to serve the model"
    )
    default_size: str | None = Field(None, description="WxH used for size=auto (default: the model's)")
    default_steps: int | None = Field(
        None, ge=1, description="num_inference_steps when a request sets none (default: the family's)"
    )
    default_guidance_scale: float | None = Field(
        None,
        allow_inf_nan=False,
        description="guidance_scale when a request sets none (default: the family's)",
    )
    default_guidance_scale_2: float | None = Field(
        None,
        allow_inf_nan=False,
        description="two-expert video models (Wan 2.2 A14B): the low-noise expert's guidance_scale_2 "
        "when a request sets none (default: the request's guidance_scale, as diffusers)",
    )
    default_true_cfg_scale: float | None = Field(
        None,
        allow_inf_nan=False,
        description="true_cfg_scale when a request sets none: the true CFG of FLUX, Qwen-Image and "
        "Kontext, which runs only with a negative prompt (default: the family's, 1 = off)",
    )
    default_negative_prompt: str | None = Field(
        None,
        max_length=4000,
        description="negative_prompt when a request sends none, e.g. ' ' to switch on true CFG by "
        "default (refused at start by a model that takes no negative prompt) (default: none)",
    )
    size_multiple: int | None = Field(
        None, ge=1, description="width and height must be multiples of this (default: the family's)"
    )
    scheduler: str | None = Field(
        None,
        description="a diffusers scheduler class to replace the model's, built from the model's "
        "scheduler config (LCMScheduler for DMD2-distilled SDXL)",
    )
    timesteps: list[int] = Field(
        default_factory=list,
        description="fixed timesteps every request runs, highest first (a distilled model's: DMD2's "
        "999 749 499 249); each request takes that many steps",
        json_schema_extra={"metavar": "T"},
    )
    max_pixels: int = Field(2048 * 2048, ge=1, description="largest width x height accepted")
    max_request_work: int | None = Field(
        None,
        ge=1,
        description="most work one request may ask for, in pixel-steps: n x frames x width x height "
        "x steps (default: 16 times the model's default request); more is refused with 400",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters requests may use, NAME=SOURCE each (SOURCE: a .safetensors file or "
        "a directory holding one, a hub id, or tiny-lora-N with a tiny model; default: none); each is "
        "listed in /v1/models and chosen with model: NAME",
    )
    max_loras: int = Field(
        4, ge=1, description="LoRA adapters loaded in the model at once (the least recently used is unloaded)"
    )
    max_upload_pixels: int = Field(
        4096 * 4096, ge=1, description="largest width x height of an uploaded image (413 beyond)"
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")

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
    def _workers(self) -> ServeSettings:
        if self.data_parallel_size > 1 and self.executor == "thread":
            raise ValueError(
                "data_parallel_size above 1 runs each pipeline in its own worker process: "
                "use executor process (or auto)"
            )
        self.worker_devices()  # raises if the devices do not fit the workers
        return self

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> Any:
        """NAME=SOURCE pairs from a flag (a list), a variable (comma-separated) or YAML (a
        mapping); names are model ids clients send."""
        if isinstance(value, str):
            value = [part for part in re.split(r"[,\s]+", value) if part]
        if isinstance(value, list | tuple):
            pairs = [str(item).partition("=") for item in value]
            if bad := [name for name, sep, source in pairs if not sep or not source.strip()]:
                raise ValueError(f"write each adapter as NAME=SOURCE, got {bad[0]!r}")
            names = [name.strip() for name, _, _ in pairs]
            if len(set(names)) < len(names):
                raise ValueError("each adapter name may be given once")
            value = {name.strip(): source.strip() for name, _, source in pairs}
        if isinstance(value, dict):
            for name in value:
                if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
                    raise ValueError(f"adapter name {name!r}: use letters, digits, '.', '_' and '-'")
        return value

    @model_validator(mode="after")
    def _adapters_named_apart(self) -> ServeSettings:
        if self.model_name in self.lora_modules:
            raise ValueError(
                f"lora_modules: {self.model_name!r} is the base model's name; name the adapter apart"
            )
        return self

    @field_validator("timesteps", mode="before")
    @classmethod
    def _split_timesteps(cls, value: Any) -> Any:
        if isinstance(value, str):  # DIFFBATCH_TIMESTEPS=999,749,499,249
            value = [value]
        if isinstance(value, list | tuple):  # --timesteps 999 749 or --timesteps 999,749
            return [part for item in value for part in re.split(r"[,\s]+", str(item)) if part]
        return value

    @field_validator("timesteps")
    @classmethod
    def _check_timesteps(cls, value: list[int]) -> list[int]:
        # Schedulers run timesteps from noisy to clean; diffusers refuses any other order.
        if any(t < 0 for t in value) or any(a <= b for a, b in itertools.pairwise(value)):
            raise ValueError(f"must be non-negative and strictly decreasing, got {value}")
        return value

    @model_validator(mode="after")
    def _steps_of_fixed_timesteps(self) -> ServeSettings:
        if self.timesteps and self.default_steps not in (None, len(self.timesteps)):
            raise ValueError(
                f"default_steps ({self.default_steps}) differs from the {len(self.timesteps)} fixed timesteps"
            )
        return self

    @field_validator("default_size")
    @classmethod
    def _check_size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE.match(value):
            raise ValueError(f"must look like 512x512, got {value!r}")
        return value

    @property
    def executor_kind(self) -> Literal["thread", "process"]:
        if self.executor == "auto":
            return "process" if self.data_parallel_size > 1 else "thread"
        return self.executor

    def worker_devices(self) -> list[str]:
        """The device of each data-parallel worker."""
        workers = self.data_parallel_size
        devices = [d.strip() for d in self.device.split(",") if d.strip()]
        if len(devices) == workers:
            return devices
        if len(devices) == 1 and workers > 1:
            if devices[0] == "cpu":
                return ["cpu"] * workers
            if devices[0] in ("cuda", "xpu", "npu"):
                return [f"{devices[0]}:{i}" for i in range(workers)]
        raise ValueError(
            f"device {self.device!r} does not name one device per worker for data_parallel_size "
            f"{workers}: give cpu, cuda (cuda:0..{workers - 1}) or {workers} devices separated by commas"
        )

    def worker_configs(self) -> list[PipelineConfig]:
        """One pipeline config per data-parallel worker: its own device and, on CPU, its
        share of the threads (so N workers do not each start a thread per core)."""
        base = self.pipeline_config()
        workers = self.data_parallel_size
        threads = self.num_threads
        if workers > 1 and self.device.strip() == "cpu":
            threads = max(1, (threads or os.cpu_count() or 1) // workers)
        return [replace(base, device=device, num_threads=threads) for device in self.worker_devices()]

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
        whole = set(ModelSetSettings.model_fields) | set(ResidencySettings.model_fields)
        values = self.model_dump(exclude=whole, exclude_unset=True)
        values.update(own, model=entry.model, served_model_name=entry.name)
        return ServeSettings(**values)

    def per_model(self) -> list[ServeSettings]:
        """The settings of each served model: one per `models` entry, or these."""
        return [self.for_entry(entry) for entry in self.models] or [self]

    @model_validator(mode="after")
    def _models_build(self) -> ServeSettings:
        # Every model's own settings are checked at start, not when it first loads.
        names = [entry.name for entry in self.models]
        for entry in self.models:
            names += list(self.for_entry(entry).lora_modules)
        # A request's `model` names a model or an adapter: each must name one thing.
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"models: {', '.join(repeated)} names more than one model or adapter")
        return self

    def pipeline_config(self) -> PipelineConfig:
        size = None
        if self.default_size:
            width, height = self.default_size.split("x")
            size = (int(width), int(height))
        return PipelineConfig(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            pipeline_class=self.pipeline_class,
            default_size=size,
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
            preview_decoder=self.preview_decoder,
            max_request_work=self.max_request_work,
            lora_modules=tuple(self.lora_modules.items()),
            max_loras=self.max_loras,
            memory=self.memory_config(),
            options=self.family_options(),
            prompt_cache_mb=self.prompt_cache_mb,
            cache=self.cache_choice(),
            cache_threshold=self.cache_threshold,
            denoiser=self.denoiser_config(),
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


# What one of several models may set for itself: the model's own settings, batching,
# workers and memory; HTTP, jobs, outputs, webhooks and Ray are the server's.
_PER_MODEL = (
    set(ServeSettings.model_fields)
    - set(HttpSettings.model_fields)
    - set(JobSettings.model_fields)
    - set(OutputSettings.model_fields)
    - set(WebhookSettings.model_fields)
    - set(GatewaySettings.model_fields)
    - set(ModelSetSettings.model_fields)
    - {"ray_address", "replicas", "max_replicas", "ray_router", "shutdown_timeout_s", "log_level"}
    # Read by the routes from the server's settings, before a request reaches a model.
    - {"result_cache_mb", "request_timeout_s", "video_timeout_s", "max_upload_pixels"}
)
