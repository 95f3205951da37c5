"""Gains on random weights that make a tiny model's image follow its inputs (issue 47).

Random initialisation leaves some inputs almost without effect: a VAE encoder whose latents
barely differ between two pictures, a decoder that maps any latent to nearly the same grey,
attention spread so evenly that a reference's tokens are lost among the others. The
exactness tests compare images within 1/255, so an input that moves the image less cannot be
seen going to the wrong request. These gains scale chosen weights after a seeded
initialisation; they keep every build byte-identical. `tests/pipelines/test_sensitivity.py`
measures what each input moves.
"""

from __future__ import annotations

import torch
from torch import nn


def scale(module: nn.Module, gain: float) -> None:
    """Multiply a layer's weight and bias by `gain` (its output, for a linear layer)."""
    with torch.no_grad():
        for parameter in (getattr(module, "weight", None), getattr(module, "bias", None)):
            if parameter is not None:
                parameter.mul_(gain)


def scale_latent_means(conv: nn.Module, latent_channels: int, gain: float) -> None:
    """Scale the mean half of a VAE encoder's last convolution (means, then log-variances), so
    that two pictures' latents differ by about as much as the noise they are mixed with."""
    with torch.no_grad():
        conv.weight[:latent_channels].mul_(gain)  # type: ignore[index]
        if conv.bias is not None:
            conv.bias[:latent_channels].mul_(gain)  # type: ignore[index]
