"""Builder of `tiny-chroma`: a ChromaPipeline with small random weights.

Chroma is FLUX.1-schnell's layout with the pooled CLIP input and the per-block modulation
layers removed: one small MLP (the "distilled guidance layer", an approximator) maps the
timestep to every block's shift/scale/gate at once, and T5 alone conditions it, with an
attention mask over the T5 padding (kept one token past each prompt). Guidance is true
classifier-free guidance with a negative prompt. The VAE, scheduler and 2x2 packing are
FLUX.1's (see `pipelines.tiny.flux`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel
from transformers import T5Config, T5EncoderModel

from pipelines.tiny.encoders import t5_config_fields
from pipelines.tiny.flux import LATENT_CHANNELS, flux1_scheduler, flux1_vae
from pipelines.tiny.gains import text_guided_joint
from pipelines.tiny.tokenizers import t5_tokenizer

_TEXT_DIM = 32
# Gains on the text keys and values and the output projection (`pipelines.tiny.gains`): with plain
# random weights guidance +0.5 moved pixels by 3/255, with them by 12/255 (issue 47).
_TEXT_KEY_GAIN = 4.0
_TEXT_VALUE_GAIN = 4.0
_OUTPUT_GAIN = 4.0


def build_tiny_chroma(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(**t5_config_fields(tokenizer, d_model=_TEXT_DIM))).eval()
    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS * 4,
        num_layers=1,  # Chroma1: 19 double-stream and 38 single-stream blocks.
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),  # Sums to attention_head_dim (Chroma1: 16, 56, 56 of 128).
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=2,  # Chroma1: 5.
    )
    text_guided_joint(transformer, key=_TEXT_KEY_GAIN, value=_TEXT_VALUE_GAIN, output=_OUTPUT_GAIN)
    pipe = ChromaPipeline(
        scheduler=flux1_scheduler(),
        vae=flux1_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
