"""The denoiser settings of `ServeSettings` (a base it inherits, so each is a flag and a YAML
key like the rest): compiled or not (`--compile`), and the attention kernels
(`--attention-backend`).

Checked with `pipelines.denoiser.options` (torch-free) when the settings are built, so a
value no device could run stops the start with a message naming the flag. Packages and the
GPU's compute capability are checked where the model loads (`pipelines.denoiser.loading`),
still before the server answers.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from pipelines.denoiser.options import (
    ATTENTION_BACKENDS,
    AttentionBackendChoice,
    CompileMode,
    DenoiserConfig,
    DenoiserSettingError,
    check_device,
)
from server.switches import switch_word

_SIZE = re.compile(r"^\d+x\d+$")


class DenoiserSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # A YAML preset's bare `compile: off` arrives as False (YAML 1.1), read as the word.
    compile: Annotated[CompileMode, BeforeValidator(switch_word)] = Field(
        "off",
        description="torch.compile the denoiser: blocks (its repeated transformer blocks, compiled "
        "once per block class: diffusers' regional compilation), full (the whole denoiser) or off; "
        "step groups of any size share the compiled graphs (the row dimension is dynamic), and a "
        "warm-up at start compiles them before the first request; recompiles are counted in "
        "/metrics",
    )
    attention_backend: AttentionBackendChoice = Field(
        "native",
        description="the denoiser's attention kernels, through diffusers' attention dispatcher: "
        f"{', '.join(ATTENTION_BACKENDS)}; native is torch's scaled_dot_product_attention; the "
        "others need CUDA (and flash, flash3, sage, xformers their packages), and a model whose "
        "attention goes through the dispatcher (the transformer families; not the UNets)",
    )

    compile_sizes: list[str] = Field(
        default_factory=list,
        description="with --compile: image sizes (WxH) besides the model's default that the warm-up "
        "at start compiles for, so no request of these sizes waits for a compile (after a second "
        "size the image dimensions are dynamic: any size then shares the graphs) (default: none)",
        json_schema_extra={"metavar": "WxH"},
    )

    @field_validator("compile_sizes", mode="before")
    @classmethod
    def _split_sizes(cls, value: Any) -> Any:
        if isinstance(value, str):  # DIFFBATCH_COMPILE_SIZES=64x64,48x48
            value = [part for part in re.split(r"[,\s]+", value) if part]
        for size in value or []:
            if not _SIZE.match(str(size)):
                raise ValueError(f"--compile-sizes: write each size as WxH (64x48), got {size!r}")
        return value

    @model_validator(mode="after")
    def _denoiser_runs_here(self) -> DenoiserSettings:
        config = self.denoiser_config()
        devices = [d.strip() for d in str(getattr(self, "device", "cpu")).split(",") if d.strip()]
        try:
            for device in devices or ["cpu"]:
                check_device(config, device)
        except DenoiserSettingError as exc:
            raise ValueError(str(exc)) from None
        if self.compile != "off" and getattr(self, "lora_modules", None):
            raise ValueError(
                "--compile: cannot go with --lora-modules (switching adapters between forwards "
                "would recompile the denoiser each time); serve LoRA adapters with --compile off"
            )
        return self

    def denoiser_config(self) -> DenoiserConfig:
        sizes = tuple(_parsed(size) for size in self.compile_sizes)
        batching: Literal["step", "request"] = "step"
        if getattr(self, "batching", "step") == "request":  # what the warm-up runs through
            batching = "request"
        return DenoiserConfig(
            self.compile, self.attention_backend, warmup_sizes=sizes, warmup_batching=batching
        )


def _parsed(size: str) -> tuple[int, int]:
    width, height = size.split("x")
    return int(width), int(height)
