"""Builders of `tiny-flux2` and `tiny-flux2-klein`: Flux2Pipeline (FLUX.2 [dev]) and
Flux2KleinPipeline (FLUX.2 [klein]) with small random weights.

Both share FLUX.2's transformer layout (double-stream then single-stream blocks, 4-axis RoPE
over (T, H, W, L) position ids, joint input = three text-encoder layers side by side) and its
VAE (AutoencoderKLFlux2: 32 latent channels, patchified 2x2 into 128 and normalized by the VAE's
batch-norm statistics). They differ in the text encoder and guidance: [dev] reads Mistral Small
3.1 (Mistral3ForConditionalGeneration, layers 10/20/30) and embeds a distilled guidance scale;
[klein] reads Qwen3 (layers 9/18/27), has no guidance embedding and runs true CFG against an
empty prompt unless `is_distilled`. Each family's default size is 128 latent pixels times the
VAE's scale factor; this VAE halves each side, so 64x64 images come from 32x32 latents (16x16
tokens after patchifying). Reference images must be at least 64 pixels a side.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)

from pipelines.tiny.gains import scale
from pipelines.tiny.mistral import TEXT_DIM as MISTRAL_DIM
from pipelines.tiny.mistral import mistral3_encoder, mistral_tokenizer
from pipelines.tiny.qwen3 import TEXT_DIM as QWEN3_DIM
from pipelines.tiny.qwen3 import qwen3_causal_lm, qwen3_tokenizer

# FLUX.2's VAE latent channels; the transformer sees them patchified 2x2.
_LATENT_CHANNELS = 32
# Gains on the transformer's text and image keys, and a VAE without biases. With plain random
# weights attention spreads so thinly that another prompt or reference image moved pixels by
# under 1/255 (0.002 and 0.0009), too little for a test to see a prompt or a reference go to the
# wrong image; with these, about 0.005 and 0.01.
_TEXT_KEY_GAIN = 20.0
_IMAGE_KEY_GAIN = 10.0
# Issue 47 (`pipelines.tiny.gains`): with the keys alone, [dev]'s prompt, references and cache
# setting and [klein]'s guidance +0.5 moved pixels by 2-6/255. Stronger text and image values in
# the double-stream attention (what a prompt or a reference carries into the picture's tokens)
# and a stronger output projection bring each to 20/255 or more, the images no more saturated.
_TEXT_VALUE_GAIN = 6.0
_IMAGE_VALUE_GAIN = 6.0
_OUTPUT_GAIN = 3.0
# diffusers' Flux2Pipeline.system_message: the tokenizer learns its words whole.
_SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on "
    "object relationships, object attribution and actions without speculation."
)


def build_tiny_flux2(directory: Path) -> None:
    """Build Flux2Pipeline with fixed seeds and save it to `directory`."""
    tokenizer = mistral_tokenizer(_SYSTEM_MESSAGE)
    pipe = Flux2Pipeline(
        scheduler=flux2_scheduler(),
        vae=flux2_vae(),
        text_encoder=mistral3_encoder(tokenizer),
        tokenizer=tokenizer,  # The real model's is a PixtralProcessor: see pipelines.tiny.mistral.
        transformer=flux2_transformer(text_dim=MISTRAL_DIM, guidance_embeds=True),
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def build_tiny_flux2_klein(directory: Path) -> None:
    """Build Flux2KleinPipeline (the base model: true CFG, not step-distilled) with fixed seeds."""
    tokenizer = qwen3_tokenizer()
    pipe = Flux2KleinPipeline(
        scheduler=flux2_scheduler(),
        vae=flux2_vae(),
        text_encoder=qwen3_causal_lm(tokenizer, layers=27),  # Reads layers 9, 18 and 27.
        tokenizer=tokenizer,
        transformer=flux2_transformer(text_dim=QWEN3_DIM, guidance_embeds=False),
        is_distilled=False,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def flux2_transformer(text_dim: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=_LATENT_CHANNELS * 4,
        num_layers=1,  # [dev]: 8 double-stream and 48 single-stream; [klein] 4B: 5 and 20.
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * text_dim,  # Three hidden-state layers, stacked on channels.
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # (T, H, W, L); sums to attention_head_dim.
        guidance_embeds=guidance_embeds,
    )
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_added_k.weight.mul_(_TEXT_KEY_GAIN)
            block.attn.norm_k.weight.mul_(_IMAGE_KEY_GAIN)
            scale(block.attn.add_v_proj, _TEXT_VALUE_GAIN)
            scale(block.attn.to_v, _IMAGE_VALUE_GAIN)
        for single in transformer.single_transformer_blocks:
            single.attn.norm_k.weight.mul_(_IMAGE_KEY_GAIN)
    scale(transformer.proj_out, _OUTPUT_GAIN)
    return transformer


def flux2_vae() -> AutoencoderKLFlux2:
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=16,
        sample_size=64,
    )
    with torch.no_grad():
        for name, parameter in vae.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    return vae


def flux2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # FLUX.2's: the pipeline passes its own sigmas and an empirical mu (compute_empirical_mu).
    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
