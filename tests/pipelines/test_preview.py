"""The linear preview decoder: it learns a latent-to-RGB map from decoded images."""

from __future__ import annotations

import numpy as np
import torch

from pipelines.stepping.preview import MIN_IMAGES, LinearPreview


def images_of(grid: torch.Tensor, weights: torch.Tensor, scale: int) -> np.ndarray:
    """What a perfectly linear 'VAE' makes of `grid`: each latent pixel a flat patch."""
    rgb = torch.einsum("bchw,ck->bhwk", grid, weights[:-1]) + weights[-1]
    return rgb.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2).numpy()


def test_it_recovers_a_linear_decoder_once_it_has_seen_enough_images() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(5, 3, generator=generator, dtype=torch.float64) * 0.2 + 0.1  # 4 channels + bias
    preview = LinearPreview()
    for _ in range(MIN_IMAGES):
        assert not preview.ready
        grid = torch.rand(1, 4, 8, 8, generator=generator, dtype=torch.float64)
        preview.observe(grid, images_of(grid, weights, scale=8))
    assert preview.ready
    new = torch.rand(2, 4, 8, 8, generator=generator, dtype=torch.float64)
    decoded = preview.decode(new, 64, 64)
    expected = np.clip(images_of(new, weights, scale=8), 0, 1) * 255
    assert [d.shape for d in decoded] == [(64, 64, 3)] * 2 and decoded[0].dtype == np.uint8
    assert np.abs(np.stack(decoded).astype(float) - expected).max() <= 1


def test_a_new_latent_layout_starts_the_fit_again() -> None:
    preview = LinearPreview()
    for _ in range(MIN_IMAGES):
        preview.observe(torch.rand(1, 4, 8, 8), np.random.rand(1, 64, 64, 3))
    preview.observe(torch.rand(1, 16, 8, 8), np.random.rand(1, 64, 64, 3))
    assert preview.images_seen == 1 and not preview.ready
