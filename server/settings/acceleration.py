"""What makes a model's requests cheaper, each a flag and a YAML key (`ServeSettings`
inherits these groups): the denoiser compiled or not (`--compile`), its attention kernels
(`--attention-backend`), and caches: prompt embeddings kept, and cache acceleration
(First-Block Cache, TaylorSeer) for requests that choose none.

The denoiser settings are checked with `pipelines.denoiser.options` (torch-free) when the
settings are built, so a value no device could run stops the start with a message naming
the flag. Packages and the
GPU's compute capability are checked where the model loads (`pipelines.denoiser.loading`),
still before the server answers.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from engine.request import TAYLOR_SEER_DEFAULTS, TAYLOR_SEER_LIMITS, CacheChoice
from pipelines.denoiser.options import (
    ATTENTION_BACKENDS,
    AttentionBackendChoice,
    CompileMode,
    DenoiserConfig,
    DenoiserSettingError,
    check_device,
)
from server.settings.section import MODEL_SECTION, Section
from server.settings.switches import switch_word

_SIZE = re.compile(r"^\d+x\d+$")


class DenoiserSettings(Section):
    help_section = "compiled denoisers and attention kernels"
    each_model = True

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


class CacheSettings(Section):
    """The prompt-embedding cache in each worker (`pipelines.prompt_cache`), and the cache
    acceleration requests that choose no `cache` get (`engine.request.CacheChoice`)."""

    help_section = MODEL_SECTION
    each_model = True

    # 256 MiB: a FLUX or Wan prompt (T5/UMT5, 512 tokens x 4096, bfloat16, and its pooled
    # row) is about 4 MiB, so ~60 of the largest prompts, thousands of CLIP ones (118 KiB), at
    # well under 1% of an 80 GB device; it lives where the text encoder's outputs do.
    prompt_cache_mb: float = Field(
        256.0,
        ge=0,
        allow_inf_nan=False,
        description="identical prompts and negative prompts are encoded once while they stay in "
        "an LRU of this many MiB per model and worker, kept on the device (0 = off)",
    )
    cache: Literal["none", "first-block", "taylorseer"] = Field(
        "none",
        description="cache acceleration for requests that choose none (a request's own "
        '"cache": {"mode", "threshold"} replaces it): first-block skips the denoiser\'s later '
        "blocks at steps where its first block's output changed by less than --cache-threshold "
        "(DiT families; in step mode each request decides for itself); taylorseer predicts "
        "the denoiser's output between the steps it runs (--cache-interval, --cache-warmup, "
        "--cache-order; in step mode each request by its own steps); or none",
    )
    cache_threshold: float = Field(
        0.1,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="with --cache first-block: the relative change of the first block's residual "
        "below which a step reuses the rest of the blocks' last effect; higher skips more, "
        "0 skips nothing",
    )
    cache_interval: int = Field(
        TAYLOR_SEER_DEFAULTS["interval"],
        ge=1,
        le=TAYLOR_SEER_LIMITS["interval"],
        description="with --cache taylorseer: after the warm-up, the denoiser runs one step in "
        "this many and the steps between are predicted from its last outputs (1 = every step)",
    )
    cache_warmup: int = Field(
        TAYLOR_SEER_DEFAULTS["warmup"],
        ge=0,
        le=TAYLOR_SEER_LIMITS["warmup"],
        description="with --cache taylorseer: the first steps of each request that always run",
    )
    cache_order: int = Field(
        TAYLOR_SEER_DEFAULTS["order"],
        ge=0,
        le=TAYLOR_SEER_LIMITS["order"],
        description="with --cache taylorseer: the Taylor series' order (0 reuses the last output, "
        "1 extrapolates its trend)",
    )

    def cache_choice(self) -> CacheChoice:
        if self.cache == "taylorseer":
            return CacheChoice(self.cache, **self.taylor_seer())
        return CacheChoice(self.cache, self.cache_threshold)

    def taylor_seer(self) -> dict[str, int]:
        """The `CacheChoice` fields these settings give."""
        return {"interval": self.cache_interval, "warmup": self.cache_warmup, "order": self.cache_order}


def _parsed(size: str) -> tuple[int, int]:
    width, height = size.split("x")
    return int(width), int(height)
