"""Builder of `tiny-flux-fill`: a FluxFillPipeline with small random weights.

FLUX.1-Fill [dev] is FLUX.1-dev with a wider input: each packed token carries the noisy
latents (16 channels x 2x2), the masked image's latents (the same 64) and the mask, folded
from pixels into channels (one channel per pixel of a VAE cell, times the 2x2 packing) — so
`in_channels` = 64 + 64 + 4 * vae_scale_factor**2 and the output stays 64 channels. The real
VAE divides by 8 (64 + 64 + 256 = 384); this one halves each side, so 64 + 64 + 16 = 144.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import FluxFillPipeline

from pipelines.tiny.flux import LATENT_CHANNELS, flux_components, flux_transformer, text_guided

# The tiny VAE's scale factor (two stages: 2x).
_VAE_SCALE_FACTOR = 2


def build_tiny_flux_fill(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    packed = LATENT_CHANNELS * 4
    transformer = text_guided(
        flux_transformer(in_channels=2 * packed + 4 * _VAE_SCALE_FACTOR**2, out_channels=packed)
    )
    pipe = FluxFillPipeline(**flux_components(transformer))
    if pipe.vae_scale_factor != _VAE_SCALE_FACTOR:
        raise RuntimeError(f"the transformer's mask channels assume a {_VAE_SCALE_FACTOR}x VAE")
    pipe.save_pretrained(directory, safe_serialization=True)
