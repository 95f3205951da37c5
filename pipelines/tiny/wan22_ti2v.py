"""Builder of `tiny-wan22-ti2v`: Wan 2.2 TI2V-5B (text- and image-to-video in one model) with small
random weights.

TI2V-5B is a WanPipeline with `expand_timesteps`: the transformer takes one timestep per latent
token. For text-to-video every token has the step's timestep; the same weights loaded as a
WanImageToVideoPipeline (`from_pipe`) do image-to-video by holding the first latent frame at the
input image's latents, whose tokens get timestep 0. No image encoder, no condition channels: the
transformer reads the 48 latent channels only.

Its VAE is Wan 2.2's: 48 latent channels, a residual encoder and decoder (`is_residual`), and a
2x2 pixel patching in front (12 input channels), so it compresses 16x in space (8x by its three
downsampling stages, 2x by the patching) and 4x in time. With the transformer's 2x2 patches, sides
are multiples of 32: a 32x32 frame is 2x2 latents, one token. Frames are 4k+1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from pipelines.tiny.gains import scale, scale_each
from pipelines.tiny.tokenizers import t5_tokenizer
from pipelines.tiny.wan import TEXT_DIM, wan_scheduler, wan_text_encoder

# Wan 2.2's VAE latent channels.
LATENT_CHANNELS = 48
# The published schedule shift of TI2V-5B (Wan-AI's wan/configs/wan_ti2v_5B.py).
FLOW_SHIFT = 5.0
# Gains (`pipelines.tiny.gains`), issue 47. With plain random weights the cross-attention spread
# evenly over the 512 padded text tokens: another prompt moved the video by 3/255, a negative by
# 2, guidance +0.5 by 1 and the cache setting by 4. Sharper text keys (tiny-wan's gain), stronger
# text values and a stronger output projection bring each above 15/255 (a prompt to about 100),
# with under 2% of the pixels at 0 or 255, as before.
_TEXT_KEY_GAIN = 5.0
_TEXT_VALUE_GAIN = 2.0
_OUTPUT_GAIN = 3.0


def build_tiny_wan22_ti2v(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)  # The pipeline pads every prompt to 512 tokens.
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=wan_text_encoder(tokenizer),
        transformer=_transformer(),
        vae=_vae(),
        scheduler=wan_scheduler(flow_shift=FLOW_SHIFT),
        expand_timesteps=True,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def _transformer() -> WanTransformer3DModel:
    torch.manual_seed(0)
    # TI2V-5B: Wan's transformer (3072 wide, 30 layers) over 48 channels in (1, 2, 2) patches.
    transformer = WanTransformer3DModel(
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
    )
    scale_each(transformer, "attn2.norm_k", _TEXT_KEY_GAIN)
    scale_each(transformer, "attn2.to_v", _TEXT_VALUE_GAIN)
    scale(transformer.proj_out, _OUTPUT_GAIN)
    return transformer


def _vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    # Wan 2.2's VAE: base_dim 160 / decoder_base_dim 256, dim_mult [1, 2, 4, 4], 2 res blocks.
    # Its latent statistics are 48 published constants; the tiny one's latents are not trained,
    # so it takes the identity (mean 0, std 1).
    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],  # Three downsampling stages: 8x, then the 2x patching.
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # Two in time: 4x.
        latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS,
        is_residual=True,
        in_channels=12,  # 3 colour channels x the 2x2 patch.
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
    )
