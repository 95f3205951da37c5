"""Builders of `tiny-sd` (a StableDiffusionPipeline with small random weights) and
`tiny-sd-inpaint` (the same parts as a StableDiffusionInpaintPipeline: its UNet takes the
latents, the mask and the masked image's latents, 4 + 1 + 4 channels)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTokenizer

from pipelines.tiny.bpe import clip_vocab
from pipelines.tiny.encoders import clip_text_config
from pipelines.tiny.gains import scale_following_decoder, text_guided_unet

# 64x64 images: 32x32 latents (the VAE halves each side) times a 2x upscale.
_SAMPLE_SIZE = 32
# The inpainting model's decoder reads its latents at a twentieth of their scale, and draws
# at 0.85 of its contrast (`scale_following_decoder`): only the mask's box, a quarter of the
# picture, is redrawn, and guidance +0.5 moved it by 6/255 (then 14/255, with 0.6% of its
# pixels at 0 or 255 against 1.0% before and tiny-sd's 0.8%). Tiny-sd, its whole picture
# redrawn, moves by 9/255 without it.
_INPAINT_DECODER_READING = 0.05
_INPAINT_DECODER_CONTRAST = 0.85


def build_tiny_sd(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    _build(directory, inpaint=False)


def build_tiny_sd_inpaint(directory: Path) -> None:
    _build(directory, inpaint=True)


def _build(directory: Path, *, inpaint: bool) -> None:
    vocab, merges = clip_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        clip_text_config(vocab)
    ).eval()  # Dropout would otherwise stay on in a directly constructed model.

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=_SAMPLE_SIZE,
        in_channels=9 if inpaint else 4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    text_guided_unet(unet)
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=16,
        sample_size=_SAMPLE_SIZE * 2,
    )
    if inpaint:
        scale_following_decoder(vae, _INPAINT_DECODER_READING, _INPAINT_DECODER_CONTRAST)
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    kind = StableDiffusionInpaintPipeline if inpaint else StableDiffusionPipeline
    pipe = kind(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
