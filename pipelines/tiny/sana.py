"""Builder of `tiny-sana`: a SanaPipeline with small random weights.

Sana is a linear-attention DiT (ReLU linear self-attention, Mix-FFN with a depthwise conv)
with cross-attention to a Gemma-2 encoder's last hidden state, over the 32-channel latents of
a deep-compression autoencoder (AutoencoderDC: 32x per side in the real model, so 1024x1024
images are 32x32 tokens with patch size 1). The scheduler is DPM-Solver++ on flow-matching
sigmas (`use_flow_sigmas`, `flow_shift`). By default the pipeline prepends a long "complex
human instruction" to every prompt before Gemma sees it. Like PixArt-Σ it has no adapter here
and tests the generic request-level adapter; its size binning keys on `sample_size` (16 ->
the 512-pixel bins), so tiny calls pass `use_resolution_binning=False`.

This autoencoder has three stages (4x per side): 64x64 images are 16x16 latents and tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
from transformers import Gemma2Config, Gemma2Model

from pipelines.tiny.gemma import gemma_tokenizer

_TEXT_DIM = 16
_LATENT_CHANNELS = 32


def build_tiny_sana(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = gemma_tokenizer(max_length=1024)
    torch.manual_seed(0)
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=2048,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()
    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=2,  # Sana 1.6B: 70 heads of 32, 20 layers, cross-attention 20 x 112.
        attention_head_dim=8,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=_TEXT_DIM,
        sample_size=16,
        patch_size=1,
    )
    torch.manual_seed(0)
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=_LATENT_CHANNELS,
        attention_head_dim=8,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16, 32),
        decoder_block_out_channels=(8, 16, 32),
        encoder_layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)),
        decoder_qkv_multiscales=((), (), (5,)),
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    scheduler = DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )  # Sana 1.0's.
    pipe = SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    pipe.save_pretrained(directory, safe_serialization=True)
