"""Builder of `tiny-flux`: a FluxPipeline with small random weights.

FluxPipeline's default size is 128 latent pixels times the VAE's scale factor (a constant
in diffusers, not a config field), so no VAE gives a 64x64 default: this one halves each
side, making 64x64 images from 32x32 latents and defaulting to 256x256. Callers pass sizes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

from pipelines.tiny.bpe import clip_vocab
from pipelines.tiny.encoders import clip_text_config, t5_config_fields
from pipelines.tiny.tokenizers import t5_tokenizer

# Width of both text encoders: the transformer's pooled (CLIP) and joint (T5) inputs.
_TEXT_DIM = 32
# Flux's VAE latent channels; the transformer sees them packed in 2x2 patches.
_LATENT_CHANNELS = 16


def build_tiny_flux(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    vocab, merges = clip_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tokenizer_2 = t5_tokenizer(max_length=512)

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        clip_text_config(vocab)
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(T5Config(**t5_config_fields(tokenizer_2, d_model=_TEXT_DIM))).eval()

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=_LATENT_CHANNELS * 4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_TEXT_DIM,
        guidance_embeds=True,  # Like FLUX.1-dev: guidance_scale is a model input, not CFG.
        axes_dims_rope=(4, 4, 8),  # Sums to attention_head_dim.
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=16,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    # FLUX.1-dev's schedule: the shift grows with the number of image tokens.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
