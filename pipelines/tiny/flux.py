"""Builder of `tiny-flux`: a FluxPipeline with small random weights, and the FLUX.1 components
the Kontext and Fill tiny models share.

FluxPipeline's default size is 128 latent pixels times the VAE's scale factor (a constant
in diffusers, not a config field), so no VAE gives a 64x64 default: this one halves each
side, making 64x64 images from 32x32 latents and defaulting to 256x256. Callers pass sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

from pipelines.tiny.bpe import clip_vocab
from pipelines.tiny.encoders import clip_text_config, t5_config_fields
from pipelines.tiny.gains import scale, text_guided_joint
from pipelines.tiny.tokenizers import t5_tokenizer

# Width of both text encoders: the transformer's pooled (CLIP) and joint (T5) inputs.
_TEXT_DIM = 32
# Flux's VAE latent channels; the transformer sees them packed in 2x2 patches.
LATENT_CHANNELS = 16


def build_tiny_flux(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    pipe = FluxPipeline(**flux_components(text_guided(flux_transformer())))
    pipe.save_pretrained(directory, safe_serialization=True)


def flux_components(transformer: FluxTransformer2DModel) -> dict[str, Any]:
    """FLUX.1's components around `transformer`: both text encoders, the VAE, the scheduler."""
    vocab, merges = clip_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tokenizer_2 = t5_tokenizer(max_length=512)

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        clip_text_config(vocab)
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(T5Config(**t5_config_fields(tokenizer_2, d_model=_TEXT_DIM))).eval()
    return {
        "scheduler": flux1_scheduler(),
        "vae": flux1_vae(),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "transformer": transformer,
    }


def flux1_vae() -> AutoencoderKL:
    """FLUX.1's VAE layout (16 latent channels, no quant convs, its scaling and shift), two
    stages: 2x instead of 8x (also Chroma's and Z-Image's VAE)."""
    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=16,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def flux1_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # FLUX.1-dev's schedule: the shift grows with the number of image tokens.
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def flux_transformer(
    in_channels: int = LATENT_CHANNELS * 4,
    out_channels: int | None = None,
    image_key_gain: float = 1.0,
    mixing_gain: float = 1.0,
) -> FluxTransformer2DModel:
    """FLUX.1-dev's transformer, one double- and one single-stream block; Fill widens its input.

    `image_key_gain` scales the image tokens' attention keys and `mixing_gain` the double-stream
    block's image attention output (Kontext: see its builder).
    """
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        out_channels=out_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_TEXT_DIM,
        guidance_embeds=True,  # Like FLUX.1-dev: guidance_scale is a model input, not CFG.
        axes_dims_rope=(4, 4, 8),  # Sums to attention_head_dim.
    )
    if image_key_gain != 1.0:
        with torch.no_grad():
            for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
                block.attn.norm_k.weight.mul_(image_key_gain)
    for block in transformer.transformer_blocks:
        scale(block.attn.to_out[0], mixing_gain)
    return transformer


def text_guided(transformer: FluxTransformer2DModel) -> FluxTransformer2DModel:
    """Make a tiny FLUX.1 transformer follow its text and its guidance scale (tiny-flux, Fill).

    With plain random weights a negative prompt under true CFG moved pixels by 4/255, true CFG
    +0.5 by 3 and the embedded guidance +0.5 by 6: too little for a test to see one go to the
    wrong request (issue 47). Sharper text keys and stronger text values in the joint attention,
    a stronger guidance embedding and output projection bring each above 10/255."""
    text_guided_joint(transformer, key=4.0, value=4.0, output=4.0)
    scale(transformer.time_text_embed.guidance_embedder.linear_2, 2.0)
    return transformer
