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
from transformers import UMT5Config, UMT5EncoderModel

from pipelines.tiny.tokenizers import t5_tokenizer

# Width of the text encoder's hidden states, the transformer's text input.
_TEXT_DIM = 32
# Wan's VAE latent channels.
_LATENT_CHANNELS = 16
# Scales the transformer's cross-attention keys. Every prompt reaches it zero-padded to 512
# tokens with no mask, and random weights spread attention so evenly over that padding that
# "a cat" and "dog" moved pixels by about 2e-5, too little for a test to see a prompt go to
# the wrong video; sharper text attention makes any two prompts differ by more than 0.05.
_TEXT_KEY_GAIN = 5.0


def build_tiny_wan(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)  # WanPipeline pads every prompt to 512 tokens.

    torch.manual_seed(0)
    # Wan's text encoder is UMT5 (google/umt5-xxl): T5 with per-layer relative attention biases.
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=_TEXT_DIM,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # Rotary sections: 4 for frames, 4 for height, 4 for width.
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        text_dim=_TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )
    with torch.no_grad():
        for block in transformer.blocks:
            block.attn2.norm_k.weight.mul_(_TEXT_KEY_GAIN)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],  # Three downsampling stages: 8x, as scale_factor_spatial says.
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # Two in time: 4x, as scale_factor_temporal says.
    )
    # Wan 2.1's schedule (480p): UniPC over flow-matching sigmas shifted by 3.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
