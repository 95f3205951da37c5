"""Builder of `tiny-sd3`: a StableDiffusion3Pipeline with small random weights."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
)

from pipelines.tiny.bpe import clip_vocab
from pipelines.tiny.encoders import clip_text_config, t5_config_fields
from pipelines.tiny.gains import scale, scale_each
from pipelines.tiny.tokenizers import t5_tokenizer

# 64x64 images: 32x32 latents (the VAE halves each side) times a 2x upscale.
_SAMPLE_SIZE = 32
# Width of each CLIP encoder; their hidden states are concatenated to the T5 width.
_CLIP_DIM = 32
_T5_DIM = 2 * _CLIP_DIM
# Gains on the text keys and values of the joint attention and on the output projection
# (`pipelines.tiny.gains`): with plain random weights guidance +0.5 moved pixels by 5/255, with
# them by 8/255 and another prompt by 105/255 (issue 47); stronger key, value and output gains
# move guidance no further, a stronger attention output (x2) to 10/255 (prompt 134).
_TEXT_KEY_GAIN = 3.0
_TEXT_VALUE_GAIN = 3.0
_OUTPUT_GAIN = 3.0
_MIXING_GAIN = 2.0


def build_tiny_sd3(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    vocab, merges = clip_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tokenizer_2 = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tokenizer_3 = t5_tokenizer(max_length=512)
    clip_config = clip_text_config(vocab, projection_dim=_CLIP_DIM)

    torch.manual_seed(0)
    # Dropout would otherwise stay on in directly constructed models.
    text_encoder = CLIPTextModelWithProjection(clip_config).eval()
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(clip_config).eval()
    torch.manual_seed(0)
    text_encoder_3 = T5EncoderModel(
        T5Config(**t5_config_fields(tokenizer_3, d_model=_T5_DIM, d_kv=16, d_ff=128))
    ).eval()

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=_SAMPLE_SIZE,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=_T5_DIM,
        caption_projection_dim=32,  # Must equal num_attention_heads * attention_head_dim.
        pooled_projection_dim=2 * _CLIP_DIM,
        pos_embed_max_size=32,
    )
    scale_each(transformer, "attn.add_k_proj", _TEXT_KEY_GAIN)
    scale_each(transformer, "attn.add_v_proj", _TEXT_VALUE_GAIN)
    scale(transformer.get_submodule("proj_out"), _OUTPUT_GAIN)
    scale_each(transformer, "attn.to_out.0", _MIXING_GAIN)
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=16,
        norm_num_groups=16,
        sample_size=_SAMPLE_SIZE * 2,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
