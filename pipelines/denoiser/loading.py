"""What `pipelines.loading.load_diffusers` does for the denoiser: refuse at once what this
host cannot run, then, once the pipeline is loaded and fitted, route its attention through
the configured backend and wrap it for compilation (the attention first: the compiled
graphs trace whichever kernels the dispatcher calls)."""

from __future__ import annotations

from typing import Any

from pipelines.base import PipelineConfig
from pipelines.denoiser.attention import check_capability, set_attention_backend
from pipelines.denoiser.compiling import compile_denoisers
from pipelines.denoiser.options import check_device, check_packages


def check_denoiser(config: PipelineConfig) -> None:
    """Before anything loads: the flags' values, the packages, the device."""
    check_device(config.denoiser, config.device)
    check_packages(config.denoiser)
    check_capability(config.denoiser, config.device)


def prepare_denoiser(pipe: Any, config: PipelineConfig) -> None:
    set_attention_backend(pipe, config.denoiser, config.device)
    compile_denoisers(pipe, config.denoiser.compile)
