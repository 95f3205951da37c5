"""The GPU check's random-weight models have the published sizes (built on the meta device:
shapes only, no memory, so this runs anywhere)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel

from bench.fullsize import (
    FLUX_TRANSFORMER,
    SDXL_UNET,
    RandomFlux,
    RandomSDXL,
    build_flux,
    build_on,
    build_sdxl,
    flux_vae,
    sdxl_vae,
)
from pipelines.base import PipelineConfig

pytestmark = pytest.mark.slow


def billions(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e9


def test_denoisers_and_vaes_have_the_published_sizes() -> None:
    with torch.device("meta"):
        assert billions(UNet2DConditionModel(**SDXL_UNET)) == pytest.approx(2.567, abs=0.005)
        assert billions(FluxTransformer2DModel(**FLUX_TRANSFORMER)) == pytest.approx(11.90, abs=0.01)
        assert billions(sdxl_vae()) == pytest.approx(0.0837, abs=0.001)
        assert flux_vae().config.latent_channels == 16


@pytest.mark.parametrize(("adapter", "build"), [(RandomSDXL, build_sdxl), (RandomFlux, build_flux)])
def test_whole_pipelines_assemble_in_the_serving_dtype(adapter: type, build: Callable[[Any], Any]) -> None:
    config = PipelineConfig(model="random", device="meta", dtype="bfloat16")
    pipe = build_on(config, build)
    denoiser = getattr(pipe, "unet", None) or pipe.transformer
    assert denoiser.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    assert pipe.scheduler.sigmas.dtype == torch.float32  # built outside the bf16 context
    served = adapter(pipe, config)
    assert (served.default_width, served.default_height) == (1024, 1024)
