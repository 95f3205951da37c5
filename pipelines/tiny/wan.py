"""Builder of `tiny-wan`: a WanPipeline (Wan 2.1 text-to-video) with small random weights.

The VAE keeps Wan's compression (8x spatial, 4x temporal) and the transformer its (1, 2, 2)
patches, so the family's rules hold: frames are 4k+1 (the pipeline rounds others to the
nearest one, with a warning) and sides multiples of 16 (enforced). WanPipeline's default size,
480x832 with 81 frames, is a constant of its `__call__`, not a config field: callers pass
sizes (9 frames at 32x32 is 3x4x4 latents, 12 tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from pipelines.tiny.encoders import t5_config_fields
from pipelines.tiny.gains import scale, scale_latent_means
from pipelines.tiny.tokenizers import t5_tokenizer

# Width of the text encoder's hidden states, the transformer's text input.
TEXT_DIM = 32
# Wan's VAE latent channels.
LATENT_CHANNELS = 16
# Scales the transformer's cross-attention keys. Every prompt reaches it zero-padded to 512
# tokens with no mask, and random weights spread attention so evenly over that padding that
# "a cat" and "dog" moved pixels by about 2e-5, too little for a test to see a prompt go to
# the wrong video; sharper text attention makes any two prompts differ by more than 0.05.
TEXT_KEY_GAIN = 5.0
# Gains on the cross-attention output and the output projection: with the key gain alone,
# guidance +0.5 moved Wan 2.1 I2V's and Wan 2.2's videos by 1/255; with these, by 23-28/255
# (issue 47). VACE's transformer is built apart and keeps its own gains.
_TEXT_OUTPUT_GAIN = 4.0
_OUTPUT_GAIN = 3.0


def build_tiny_wan(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)  # WanPipeline pads every prompt to 512 tokens.
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=wan_text_encoder(tokenizer),
        transformer=wan_transformer(in_channels=LATENT_CHANNELS),
        vae=wan_vae(),
        scheduler=wan_scheduler(),
    )
    pipe.save_pretrained(directory, safe_serialization=True)


# The components below are shared with tiny-wan-i2v; each seeds itself, so building one never
# changes the weights of another.


def wan_text_encoder(tokenizer: T5Tokenizer) -> UMT5EncoderModel:
    torch.manual_seed(0)
    # Wan's text encoder is UMT5 (google/umt5-xxl): T5 with per-layer relative attention biases.
    encoder: UMT5EncoderModel = UMT5EncoderModel(UMT5Config(**t5_config_fields(tokenizer, d_model=TEXT_DIM)))
    return encoder.eval()  # Dropout would otherwise stay on in a directly constructed model.


def wan_transformer(in_channels: int, seed: int = 0, **extra: int) -> WanTransformer3DModel:
    """The transformer, reading `in_channels` latent channels (more with an I2V condition).

    `seed` tells apart the two experts of a Wan 2.2 two-transformer model."""
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # Rotary sections: 4 for frames, 4 for height, 4 for width.
        in_channels=in_channels,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        **extra,
    )
    for block in transformer.blocks:
        scale(block.attn2.norm_k, TEXT_KEY_GAIN)
        scale(block.attn2.to_out[0], _TEXT_OUTPUT_GAIN)
    scale(transformer.get_submodule("proj_out"), _OUTPUT_GAIN)
    return transformer


def wan_vae(base_dim: int = 3, encoder_gain: float = 1.0, decoder_gain: float = 1.0) -> AutoencoderKLWan:
    """Wan's VAE layout. The default's 3 channels halve to 1 at each upsampling, so its decoder
    makes nearly the same grey of any latent; a model whose pictures must show (VACE's control
    video and references) takes more channels and gains (`pipelines.tiny.gains`)."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],  # Three downsampling stages: 8x, as scale_factor_spatial says.
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # Two in time: 4x, as scale_factor_temporal says.
    )
    scale_latent_means(vae.quant_conv, LATENT_CHANNELS, encoder_gain)
    scale(vae.decoder.conv_out, decoder_gain)
    return vae


def wan_scheduler(flow_shift: float = 3.0) -> UniPCMultistepScheduler:
    # Wan 2.1's schedule (480p): UniPC over flow-matching sigmas shifted by 3 (Wan 2.2 shifts more).
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=flow_shift,
        num_train_timesteps=1000,
    )
