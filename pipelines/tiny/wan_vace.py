"""Builder of `tiny-wan-vace`: Wan 2.2 VACE (video with control and reference inputs; the two-expert
Wan2.2-VACE-Fun-A14B layout) with small random weights.

WanVACEPipeline encodes its conditions with the VAE: the control video split by the mask into the
part kept (`video x (1 - mask)`) and the part redrawn (`video x mask`), 2 x 16 latent channels,
plus the mask folded from each 8x8 pixel block into 64 channels (vace_in_channels 96). Reference
images become extra latent frames in front of the video, removed before decoding. A VACE block
beside transformer layers `vace_layers` reads these and adds its output, scaled by
`conditioning_scale`, to the layer's hidden states. Text encoder, VAE (8x spatial, 4x temporal)
and patches are tiny-wan's: frames 4k+1, sides multiples of 16. Like Wan 2.2 A14B, two experts
split the schedule at `boundary_ratio`; they are seeded differently.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanVACEPipeline, WanVACETransformer3DModel

from pipelines.tiny.gains import scale_each
from pipelines.tiny.tokenizers import t5_tokenizer
from pipelines.tiny.wan import (
    LATENT_CHANNELS,
    TEXT_DIM,
    TEXT_KEY_GAIN,
    wan_scheduler,
    wan_text_encoder,
    wan_vae,
)
from pipelines.tiny.wan22 import HIGH_NOISE_SEED, LOW_NOISE_SEED, T2V_BOUNDARY_RATIO, T2V_FLOW_SHIFT

# The VACE condition: kept and redrawn latents, and the 8x8 mask pixels of each latent position.
_VACE_IN_CHANNELS = 2 * LATENT_CHANNELS + 8 * 8
# Issue 47: with tiny-wan's VAE and plain random weights a reference image moved the video by
# under 1/255 and the prompt by 1/255. A VAE with channels enough to tell pictures apart
# (`wan_vae`), latents scaled to the noise's size, sharper self-attention (a reference reaches
# the video only through it: its frames are dropped before decoding) and tiny-wan's sharper
# text attention make each input move the video by more than 8/255 -- but guidance +0.5 by 3,
# and with the decoder's output x3 13% of the pixels stuck at 255. With the decoder's output x2
# (1.3% at 255), stronger text values (x4) and a stronger self-attention output (x6, was x4)
# guidance moves it by 21/255 and each reference by 24 or more (text values alone cost the
# references their share: 6/255 at x3 with the cross-attention output x2).
_VAE_BASE_DIM = 8
_VAE_ENCODER_GAIN = 10.0
_VAE_DECODER_GAIN = 2.0
_SELF_KEY_GAIN = 20.0
_MIXING_GAIN = 6.0
_TEXT_VALUE_GAIN = 4.0


def build_tiny_wan_vace(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)  # The pipeline pads every prompt to 512 tokens.
    pipe = WanVACEPipeline(
        tokenizer=tokenizer,
        text_encoder=wan_text_encoder(tokenizer),
        transformer=_transformer(HIGH_NOISE_SEED),
        transformer_2=_transformer(LOW_NOISE_SEED),
        vae=wan_vae(_VAE_BASE_DIM, _VAE_ENCODER_GAIN, _VAE_DECODER_GAIN),
        # Wan 2.2 text-to-video's boundary and shift (the VACE-Fun model builds on it).
        scheduler=wan_scheduler(flow_shift=T2V_FLOW_SHIFT),
        boundary_ratio=T2V_BOUNDARY_RATIO,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def _transformer(seed: int) -> WanVACETransformer3DModel:
    torch.manual_seed(seed)
    # The 14B VACE model adds a VACE block at every fifth of its 40 layers (0, 5, ..., 35); the tiny
    # one at both of its 2, so `conditioning_scale` has two entries.
    transformer = WanVACETransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # Rotary sections: 4 for frames, 4 for height, 4 for width.
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        vace_layers=[0, 1],
        vace_in_channels=_VACE_IN_CHANNELS,
    )
    with torch.no_grad():
        for block in transformer.blocks:
            block.attn2.norm_k.weight.mul_(TEXT_KEY_GAIN)
            block.attn1.norm_k.weight.mul_(_SELF_KEY_GAIN)
            block.attn1.to_out[0].weight.mul_(_MIXING_GAIN)
        for block in transformer.vace_blocks:
            block.attn1.norm_k.weight.mul_(_SELF_KEY_GAIN)
            block.attn1.to_out[0].weight.mul_(_MIXING_GAIN)
    scale_each(transformer, "attn2.to_v", _TEXT_VALUE_GAIN)
    return transformer
