"""Builder of `tiny-wan-i2v`: a WanImageToVideoPipeline (Wan 2.1 image-to-video) with small random weights.

Text encoder, VAE, scheduler and transformer shape are tiny-wan's, so the same rules hold:
frames are 4k+1 (others are rounded, with a warning) and sides multiples of 16 (enforced); the
default size, 480x832 with 81 frames, is a constant of `__call__`. The input image is resized
(stretched, not cropped) to the requested size and VAE-encoded as the first frame of a condition
video; the transformer reads it as 20 extra channels (a 4-channel first-frame mask and 16 latent
channels: in_channels 36). A CLIP vision encoder also turns it into 65 tokens the transformer
attends to beside the prompt. One call takes ONE image (a PIL image or a tensor) for all prompts.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanImageToVideoPipeline
from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

from pipelines.tiny.tokenizers import t5_tokenizer
from pipelines.tiny.wan import LATENT_CHANNELS, wan_scheduler, wan_text_encoder, wan_transformer, wan_vae

# The condition the transformer reads beside the noisy latents: a first-frame mask, one channel
# per frame of the VAE's 4x temporal compression, then the VAE latents of the condition video.
_CONDITION_CHANNELS = 4 + LATENT_CHANNELS
# Width of the image encoder's hidden states, the transformer's image input (`image_dim`).
_IMAGE_DIM = 4
# Side of the image encoder's square input and of its patches: 8x8 patches plus the class token.
_IMAGE_SIZE = 32
_IMAGE_PATCH = 4


def build_tiny_wan_i2v(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)  # The pipeline pads every prompt to 512 tokens.
    text_encoder = wan_text_encoder(tokenizer)

    torch.manual_seed(0)
    # Wan 2.1 I2V's image encoder is CLIP ViT-H/14; the pipeline reads its penultimate hidden states.
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=_IMAGE_DIM,
            intermediate_size=16,
            projection_dim=_IMAGE_DIM,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=_IMAGE_SIZE,
            patch_size=_IMAGE_PATCH,
        )
    ).eval()
    # The PIL backend, named explicitly: CLIPImageProcessor is the torchvision backend, which
    # transformers replaces by this class only where torchvision is missing, so naming it keeps
    # the saved files the same on every host and loads without torchvision. It resizes the
    # shortest edge to 32, then centre-crops 32x32, as Wan's CLIP does at 224.
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": _IMAGE_SIZE},
        crop_size={"height": _IMAGE_SIZE, "width": _IMAGE_SIZE},
    )

    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        image_encoder=image_encoder,
        image_processor=image_processor,
        # Adds the image tokens to cross-attention, as in Wan 2.1 I2V.
        transformer=wan_transformer(in_channels=LATENT_CHANNELS + _CONDITION_CHANNELS, image_dim=_IMAGE_DIM),
        vae=wan_vae(),
        scheduler=wan_scheduler(),
    )
    pipe.save_pretrained(directory, safe_serialization=True)
