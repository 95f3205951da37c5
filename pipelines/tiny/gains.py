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


def scale_each(module: nn.Module, suffix: str, gain: float) -> None:
    """`scale` every submodule of `module` whose qualified name ends with `suffix`; at least one must."""
    found = [m for name, m in module.named_modules() if name == suffix or name.endswith(f".{suffix}")]
    if not found:
        raise ValueError(f"{type(module).__name__} has no {suffix!r} to scale")
    for submodule in found:
        scale(submodule, gain)


def text_guided_unet(unet: nn.Module) -> None:
    """Make a tiny SD / SDXL UNet's noise prediction follow its text.

    With plain random weights the cross-attention spreads over all 77 tokens and group norms
    drown it, so the conditional and unconditional predictions barely differ: guidance +0.5
    moved pixels by 2/255. Sharper text keys, stronger cross-attention and transformer outputs,
    and a stronger output convolution (its prediction's text part grows with the rest) bring it
    to about 9/255, a prompt to over 100/255, with the images as unsaturated as before."""
    scale_each(unet, "attn2.to_k", 4.0)
    scale_each(unet, "attn2.to_out.0", 3.0)
    scale_each(unet, "proj_out", 3.0)  # Each transformer block's output, into the residual.
    scale(unet.get_submodule("conv_out"), 6.0)


def scale_following_decoder(vae: nn.Module, reading: float, contrast: float) -> None:
    """Make a tiny SD VAE's decoder follow its latents' scale, not only their direction.

    A tiny UNet's latents come out about ten times a trained one's (std ~10, from its output
    gain); its decoder's group norms then divide their overall scale out. A guidance change
    mostly rescales them, so it barely shows: +0.5 moved tiny-sd-inpaint's box by 6/255.
    Reading them at `reading` of their scale (the post-quant convolution's weight; its bias
    kept) leaves the decoder where its own biases count beside them and a rescaled latent
    draws a changed picture; `contrast` on its output convolution's weight (bias kept: the
    mean colour stays) keeps the pixels at 0 or 255 as few as before."""
    with torch.no_grad():
        vae.get_submodule("post_quant_conv").weight.mul_(reading)  # type: ignore[operator]
        vae.get_submodule("decoder.conv_out").weight.mul_(contrast)  # type: ignore[operator]


def text_guided_joint(transformer: nn.Module, key: float, value: float, output: float) -> None:
    """Make a tiny FLUX.1-layout transformer (FLUX.1, Chroma, Ovis-Image) follow its text.

    Its image tokens read the text only through the double-stream blocks' joint attention, which
    random weights spread evenly over the padded text: `key` sharpens the text keys, `value`
    strengthens what the text tokens carry, `output` scales the final projection (the
    prediction's text part grows with the rest)."""
    scale_each(transformer, "attn.norm_added_k", key)
    scale_each(transformer, "attn.add_v_proj", value)
    scale(transformer.get_submodule("proj_out"), output)
