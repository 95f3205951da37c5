"""Builder of `tiny-ovis-image`: an OvisImagePipeline with small random weights.

Ovis-Image is FLUX.1's layout (double- then single-stream blocks, 3-axis RoPE, 2x2-packed
16-channel latents from FLUX.1's VAE) conditioned on the last hidden state of a Qwen3 model
(Ovis2.5's language model) instead of CLIP + T5, with no pooled vector and no guidance
embedding: guidance is true CFG against a negative prompt ("" by default). The pipeline
prefixes each prompt with a fixed system prompt inside Qwen3's chat template and drops the
first `user_prompt_begin_id` (28) tokens of the encoder's output. This tokenizer keeps every
word of that prefix whole, which makes it 29 tokens, so the prefix's final ':' stays in the
embeddings; no prompt token is ever dropped.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import OvisImagePipeline, OvisImageTransformer2DModel

from pipelines.tiny.flux import LATENT_CHANNELS, flux1_scheduler, flux1_vae
from pipelines.tiny.gains import text_guided_joint
from pipelines.tiny.qwen3 import TEXT_DIM, qwen3_model, qwen3_tokenizer

# Gains on the transformer's text keys and values and its output projection
# (`pipelines.tiny.gains`): with plain random weights another prompt moved pixels by under 1/255
# (0.0014), too little for a test to see a prompt go to the wrong image; with a key gain of 5,
# 15/255, but guidance +0.5 only 2/255; with all three, 124/255 and 35/255 (issue 47).
_TEXT_KEY_GAIN = 10.0
_TEXT_VALUE_GAIN = 6.0
_OUTPUT_GAIN = 4.0
# diffusers' OvisImagePipeline.system_prompt: the tokenizer learns its words whole.
_SYSTEM_PROMPT = (
    "Describe the image by detailing the color, quantity, text, shape, size, texture, spatial "
    "relationships of the objects and background: "
)


def build_tiny_ovis_image(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = qwen3_tokenizer(_SYSTEM_PROMPT)
    torch.manual_seed(0)
    transformer = OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS * 4,
        out_channels=LATENT_CHANNELS * 4,
        num_layers=1,  # Ovis-Image: 6 double-stream and 27 single-stream blocks.
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(4, 6, 6),  # Sums to attention_head_dim (Ovis-Image: 16, 56, 56 of 128).
    )
    text_guided_joint(transformer, key=_TEXT_KEY_GAIN, value=_TEXT_VALUE_GAIN, output=_OUTPUT_GAIN)
    pipe = OvisImagePipeline(
        scheduler=flux1_scheduler(),
        vae=flux1_vae(),
        text_encoder=qwen3_model(tokenizer, layers=2),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
