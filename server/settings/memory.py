"""A model's memory settings, each a flag and a YAML key (`ServeSettings` inherits these
groups): per-component dtypes, offload, quantized weights, bounded decodes.

Parsed and checked with `pipelines.memory.options` (torch-free) when the settings are
built, so a value no device could serve stops the start with a message naming the flag,
before any weight loads. The backend packages are not checked here: settings are also built
where no model loads (a Ray Serve gateway), so they are checked where it loads (`diffbatch
serve` before building the app; `pipelines.memory.loading.check_memory` in every loader).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engine.worker.profile_run import ProfilePlan
from pipelines.memory.options import (
    MemoryConfig,
    MemorySettingError,
    check_device,
    parse_component_dtypes,
    parse_quantization,
)
from server.settings.section import Section
from server.settings.switches import AutoSwitch

_PIXELS = re.compile(r"^(\d+)x(\d+)x(\d+)$")


class MemorySettings(Section):
    help_section = "fitting big models"
    each_model = True

    component_dtypes: dict[str, str] = Field(
        default_factory=dict,
        description="dtypes of single components, COMPONENT=DTYPE each (vae=float32: Wan's VAE as "
        "Wan recommends; text_encoder=bfloat16), over --dtype for the rest; repeatable",
        json_schema_extra={"metavar": "COMPONENT=DTYPE"},
    )
    offload: Literal["none", "model", "group", "sequential"] = Field(
        "none",
        description="keep weights off the device until used: model (each component moves to the "
        "device when called; one component's weights resident), group (block by block, prefetched "
        "on a CUDA stream; one block resident), sequential (layer by layer; least memory, slowest) "
        "or none; model and sequential need an accelerator",
    )
    offload_to_disk: str | None = Field(
        None,
        description="with --offload group: keep the offloaded blocks in files under this directory "
        "instead of host memory (read back block by block each step); each load writes in a fresh "
        "subdirectory of its own, removed at shutdown, so servers and workers may share the path",
    )
    quantization: str | None = Field(
        None,
        description="weights stored quantized, BACKEND:SCHEME: torchao:int8wo, torchao:float8wo "
        "(CUDA, compute capability 8.9+), bitsandbytes:nf4, bitsandbytes:int8 (CUDA), "
        "layerwise:float8_e4m3fn or layerwise:float8_e5m2 (float8 storage, computed in --dtype; "
        "any device) (default: none)",
    )
    quantize_components: list[str] = Field(
        default_factory=list,
        description="components --quantization applies to (default: the denoiser: transformer, "
        "transformer_2 or unet)",
        json_schema_extra={"metavar": "COMPONENT"},
    )
    transformer_file: str | None = Field(
        None,
        description="a single-file denoiser replacing the model's own: a GGUF file (Q8_0, Q4_K ... "
        "as published for FLUX, Qwen-Image, Wan; needs the [gguf] extra) or a .safetensors file",
    )
    decode_budget: int | None = Field(
        None,
        ge=1,
        description="most images x pixels (videos: frames x pixels) one VAE decode may hold, as a "
        "number or IMAGESxWIDTHxHEIGHT (2x1024x1024); finished requests beyond it are decoded in "
        "pieces (default: unbounded, halved only when a decode runs out of memory)",
    )
    vae_tiling: AutoSwitch = Field(
        "auto",
        description="diffusers' tiled VAE decode: on (every image above the VAE's tile size), off, "
        "or auto (only an image that alone is above --decode-budget)",
    )

    profile_run: AutoSwitch = Field(
        "auto",
        description="at start, run one step group at the step budget and one decode at the decode "
        "budget on dummy requests, read the device's peak memory and lower --max-num-seqs, "
        "--max-step-tokens and --decode-budget until they fit within --gpu-memory-utilization; "
        "auto: on an accelerator only; on: also on the CPU, where the runs are made but nothing "
        "is measured (no device memory gauge), so the budgets stay; the result is in /health "
        "and /metrics",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="the fraction of the device's memory the profile run fits the budgets within",
    )

    @field_validator("component_dtypes", mode="before")
    @classmethod
    def _parse_dtypes(cls, value: Any) -> Any:
        return dict(parse_component_dtypes(value)) if value else {}

    @field_validator("quantization")
    @classmethod
    def _parse_quantization(cls, value: str | None) -> str | None:
        return None if value is None else str(parse_quantization(value))

    @field_validator("quantize_components", mode="before")
    @classmethod
    def _split_components(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part for part in re.split(r"[,\s]+", value) if part]
        return value

    @field_validator("decode_budget", mode="before")
    @classmethod
    def _parse_budget(cls, value: Any) -> Any:
        if isinstance(value, str) and (match := _PIXELS.match(value.strip())):
            count, width, height = (int(part) for part in match.groups())
            return count * width * height
        return value

    @model_validator(mode="after")
    def _runs_here(self) -> MemorySettings:
        memory = self.memory_config()
        devices = [d.strip() for d in str(getattr(self, "device", "cpu")).split(",") if d.strip()]
        try:
            for device in devices or ["cpu"]:
                check_device(memory, device)
        except MemorySettingError as exc:
            raise ValueError(str(exc)) from None
        return self

    def profile_plan(self, max_num_seqs: int, max_step_tokens: int | None) -> ProfilePlan:
        return ProfilePlan(self.profile_run, self.gpu_memory_utilization, max_num_seqs, max_step_tokens)

    def memory_config(self) -> MemoryConfig:
        return MemoryConfig(
            component_dtypes=parse_component_dtypes(self.component_dtypes),
            offload=self.offload,
            offload_to_disk=self.offload_to_disk,
            quantization=None if self.quantization is None else parse_quantization(self.quantization),
            quantize_components=tuple(self.quantize_components),
            transformer_file=self.transformer_file,
            decode_budget=self.decode_budget,
            vae_tiling=self.vae_tiling,
        )
