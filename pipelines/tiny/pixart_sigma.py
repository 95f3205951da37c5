"""Builder of `tiny-pixart-sigma`: a PixArtSigmaPipeline with small random weights.

PixArt-Σ is a DiT with cross-attention to T5 (caption_channels) and one shared adaLN-single
timestep modulation; the UNet-era 4-channel SD VAE (SDXL's scaling factor), 2x2 patches, and
a learned variance (8 output channels, of which the pipeline keeps the first 4). It has no
adapter here: it is one of the two classes that test the generic request-level adapter.

Its call snaps the requested size to an aspect-ratio bin picked by the transformer's
`sample_size` (32 -> the 256-pixel bins), then resizes the image back; tiny calls pass
`use_resolution_binning=False` to get 64x64 directly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DPMSolverMultistepScheduler,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
)
from transformers import T5Config, T5EncoderModel

from pipelines.tiny.encoders import t5_config_fields
from pipelines.tiny.tokenizers import t5_tokenizer

_TEXT_DIM = 32


def build_tiny_pixart_sigma(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=300)
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(**t5_config_fields(tokenizer, d_model=_TEXT_DIM))).eval()
    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        num_attention_heads=2,  # PixArt-Σ: 16 heads of 72, 28 layers.
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,  # Learned variance.
        num_layers=2,
        cross_attention_dim=32,
        caption_channels=_TEXT_DIM,
        sample_size=32,
        patch_size=2,
        norm_num_groups=32,
        use_additional_conditions=False,  # As PixArt-Sigma (alpha at 1024 pixels had size conditions).
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=64,
        scaling_factor=0.13025,
    )
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),  # PixArt's: DPM-Solver++ over the DDPM schedule.
    )
    pipe.save_pretrained(directory, safe_serialization=True)
