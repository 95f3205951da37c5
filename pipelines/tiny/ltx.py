"""Builder of `tiny-ltx`: an LTXPipeline (LTX-Video text-to-video) with small random weights.

The VAE keeps LTX-Video's 8x temporal compression, so frames are 8k+1 (the pipeline does not
check: other counts silently come back as the 8k+1 below them); LTXPipeline itself demands
sides that are multiples of 32 whatever the VAE. Its spatial compression is 8, not LTX's 32,
so 32x32 frames are 4x4 latents rather than one. The default size, 512x704 with 161 frames,
is a constant of `__call__`, not a config field: callers pass sizes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from transformers import T5Config, T5EncoderModel

from pipelines.tiny.encoders import t5_config_fields
from pipelines.tiny.tokenizers import t5_tokenizer

# Width of the text encoder's hidden states, the transformer's caption input.
_TEXT_DIM = 32
# The VAE's latent channels; the transformer sees them unpatched (1x1x1 patches, like LTX).
_LATENT_CHANNELS = 8
# Three of the VAE's four blocks halve time, height and width: 8x compression of each.
_SCALING = (True, True, True, False)


def build_tiny_ltx(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=128)  # LTXPipeline pads every prompt to 128 tokens.

    torch.manual_seed(0)
    text_encoder = T5EncoderModel(
        T5Config(**t5_config_fields(tokenizer, d_model=_TEXT_DIM))
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.

    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,  # Must equal num_attention_heads * attention_head_dim.
        num_layers=2,
        caption_channels=_TEXT_DIM,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=_SCALING,
        decoder_spatio_temporal_scaling=_SCALING,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        timestep_conditioning=False,  # Like LTX-Video 0.9.0: decode_timestep is ignored.
    )
    # LTX-Video's schedule: the shift grows with the number of latent tokens.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    pipe = LTXPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
