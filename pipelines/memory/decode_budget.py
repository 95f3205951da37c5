"""`--decode-budget`: the most images x pixels (videos: frames x pixels) one VAE decode
may hold, so a step group's finishers are decoded in pieces whose peak memory is bounded,
whatever the step budget let finish together. `pipelines.decode.HalvingDecode` cuts by it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pipelines.memory.options import MemoryConfig


@dataclass(frozen=True, slots=True)
class DecodeBudget:
    """`pixels`: the budget. `spatial`, `temporal`: the VAE's compression (one latent pixel
    is spatial² pixels; one latent frame after the first is `temporal` frames). `vae`: whose
    tiled decode `tiled` turns on, or None (`--vae-tiling off`, or a VAE without tiling)."""

    pixels: int
    spatial: int
    temporal: int
    vae: Any = None

    @classmethod
    def of(cls, pipe: Any, memory: MemoryConfig) -> DecodeBudget | None:
        """The budget for `pipe`'s VAE (its compression read from the pipeline, as its own
        `__call__` reads it), or None without `--decode-budget`."""
        if memory.decode_budget is None:
            return None
        spatial = _first_attribute(pipe, ("vae_scale_factor_spatial", "vae_spatial_compression_ratio"))
        spatial = spatial or _first_attribute(pipe, ("vae_scale_factor",)) or 8
        temporal = _first_attribute(pipe, ("vae_scale_factor_temporal", "vae_temporal_compression_ratio"))
        vae = getattr(pipe, "vae", None)
        tiles = memory.vae_tiling == "auto" and hasattr(vae, "enable_tiling")
        return cls(memory.decode_budget, spatial, temporal or 1, vae if tiles else None)

    def item_pixels(self, latents: torch.Tensor) -> int:
        """Pixels of one decoded image (frames x pixels of one video) of `latents`' size."""
        height, width = int(latents.shape[-2]), int(latents.shape[-1])
        frames = 1
        if latents.ndim == 5:
            frames = (int(latents.shape[2]) - 1) * self.temporal + 1
        return frames * height * width * self.spatial**2

    def images(self, latents: torch.Tensor) -> int:
        return max(1, self.pixels // self.item_pixels(latents))

    @contextlib.contextmanager
    def tiled(self, latents: torch.Tensor) -> Iterator[None]:
        """The VAE's tiled decode for this call when one image alone is above the budget
        (`--vae-tiling auto`); diffusers tiles only images above its tile size anyway."""
        vae = self.vae
        if vae is None or vae.use_tiling or self.item_pixels(latents) <= self.pixels:
            yield
            return
        vae.use_tiling = True
        try:
            yield
        finally:
            vae.use_tiling = False


def _first_attribute(pipe: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(pipe, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
