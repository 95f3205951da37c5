"""Training of the autoencoder that turns 64x64 pictures into 16x16x4 latents.

Trained first and alone (cheap: flat-colour shapes), then frozen while the denoisers learn.
An L1 + MSE reconstruction of a sampled latent with a tiny KL weight, as Stable Diffusion's
autoencoder: the sampled noise teaches the decoder to forgive the denoiser's small errors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
from diffusers import AutoencoderKL

from pipelines.trained.dataset import sample_batch
from pipelines.trained.quality import Accuracy, score_all

_KL_WEIGHT = 1e-6


def warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int, warmup: int = 50
) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up over `warmup` steps, then a cosine decay to a tenth by `steps`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) pictures as float (N, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def train_autoencoder(
    vae: AutoencoderKL,
    *,
    steps: int,
    seed: int,
    batch_size: int = 32,
    learning_rate: float = 2e-3,
    decoder_only: bool = False,
    log: Callable[[str], None] = print,
) -> AutoencoderKL:
    """Train `vae` in place for `steps` steps on fresh batches drawn from `seed`, then set
    its `scaling_factor` so the latents the denoiser sees have unit variance.

    `decoder_only` keeps the encoder, hence the latent space, as it is: a denoiser trained
    over the autoencoder stays valid while its decoder learns to draw sharper pictures."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    if decoder_only:
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
    trained = [p for p in vae.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=0.0)
    schedule = warmup_cosine(optimizer, steps)
    vae.train()
    started = time.monotonic()
    for step in range(1, steps + 1):
        pixels = to_tensor(sample_batch(rng, batch_size)[0])
        with torch.set_grad_enabled(not decoder_only):
            posterior = vae.encode(pixels).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        decoded = vae.decode(latents).sample
        recon = (decoded - pixels).abs().mean() + (decoded - pixels).square().mean()
        loss = recon + _KL_WEIGHT * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps:
            log(f"vae step {step} recon {recon.item():.4f} elapsed {time.monotonic() - started:.0f}s")
    vae.eval()
    # FLUX's pipeline adds shift_factor when decoding (None would fail); SD's ignores it.
    vae.register_to_config(shift_factor=0.0)
    if not decoder_only:  # The latent space, hence its scale, is the encoder's.
        vae.register_to_config(scaling_factor=latent_scale(vae, seed))
    log(f"vae reconstructions score {reconstruction_accuracy(vae, seed).summary()}")
    return vae


@torch.no_grad()
def reconstruction_accuracy(vae: AutoencoderKL, seed: int, count: int = 64) -> Accuracy:
    """The quality scorer on decoded latents of fresh pictures: the ceiling of any
    denoiser over this autoencoder."""
    images, captions, _ = sample_batch(np.random.default_rng(seed + 2), count)
    decoded = vae.decode(vae.encode(to_tensor(images)).latent_dist.mean).sample
    pictures = decoded.add(1).mul(127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy()
    return score_all(list(pictures), captions)


@torch.no_grad()
def latent_scale(vae: AutoencoderKL, seed: int, count: int = 256) -> float:
    """1 / the standard deviation of latent means over `count` fresh pictures."""
    images = sample_batch(np.random.default_rng(seed + 1), count)[0]
    latents = vae.encode(to_tensor(images)).latent_dist.mean
    return float(1.0 / latents.std())
