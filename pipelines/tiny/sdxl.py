"""Builders of `tiny-sdxl` (a StableDiffusionXLPipeline), `tiny-sdxl-inpaint` (its 9-channel
inpainting variant) and `tiny-sdxl-refiner` (a StableDiffusionXLImg2ImgPipeline shaped as
SDXL's refiner: the second text encoder only, aesthetic-score conditioning), with small
random weights."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from pipelines.tiny.bpe import clip_vocab
from pipelines.tiny.encoders import clip_text_config
from pipelines.tiny.gains import text_guided_unet

# 64x64 images: 32x32 latents (the VAE halves each side) times a 2x upscale.
_SAMPLE_SIZE = 32
# Width of each text encoder; the UNet attends to both, concatenated.
_TEXT_DIM = 32
# The second encoder's pooled projection, fed to the UNet's "text_time" embedding.
_PROJECTION_DIM = 32
# Each of SDXL's six size/crop conditioning numbers gets an embedding of this width.
_TIME_EMBED_DIM = 8


def build_tiny_sdxl(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    _build(directory, inpaint=False)


def build_tiny_sdxl_inpaint(directory: Path) -> None:
    """An inpainting checkpoint, shaped as SDXL's: a UNet reading 9 channels (latents, mask,
    the masked image's latents), under `StableDiffusionXLInpaintPipeline`."""
    _build(directory, inpaint=True)


def _build(directory: Path, *, inpaint: bool) -> None:
    vocab, merges = clip_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tokenizer_2 = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    text_config = clip_text_config(vocab, projection_dim=_PROJECTION_DIM)

    torch.manual_seed(0)
    # Dropout would otherwise stay on in a directly constructed model.
    text_encoder = CLIPTextModel(text_config).eval()
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(text_config).eval()

    unet = _unet(2 * _TEXT_DIM, size_ids=6, in_channels=9 if inpaint else 4)
    vae, scheduler = _vae(), _scheduler()
    pipeline_class = StableDiffusionXLInpaintPipeline if inpaint else StableDiffusionXLPipeline
    pipe = pipeline_class(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,  # SDXL's default: no negative prompt means zero embeddings.
        add_watermarker=False,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def build_tiny_sdxl_refiner(directory: Path) -> None:
    """Build the refiner-shaped pipeline with fixed seeds and save it to `directory`: like
    SDXL's refiner, it has no first text encoder, conditions on five size/crop/aesthetic
    numbers instead of six, and encodes an empty negative prompt rather than zeroing it."""
    vocab, merges = clip_vocab()
    tokenizer_2 = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    text_config = clip_text_config(vocab, projection_dim=_PROJECTION_DIM)
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(text_config).eval()
    pipe = StableDiffusionXLImg2ImgPipeline(
        vae=_vae(),
        text_encoder=None,
        text_encoder_2=text_encoder_2,
        tokenizer=None,
        tokenizer_2=tokenizer_2,
        unet=_unet(_TEXT_DIM, size_ids=5),
        scheduler=_scheduler(),
        requires_aesthetics_score=True,
        force_zeros_for_empty_prompt=False,
        add_watermarker=False,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def _unet(cross_attention_dim: int, *, size_ids: int, in_channels: int = 4) -> UNet2DConditionModel:
    """The UNet, attending to text of `cross_attention_dim` and conditioned on `size_ids`
    size/crop (and aesthetic) numbers beside the pooled text embedding."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=_SAMPLE_SIZE,
        in_channels=in_channels,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=size_ids * _TIME_EMBED_DIM + _PROJECTION_DIM,
        norm_num_groups=8,
    )
    text_guided_unet(unet)
    return unet


def _vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=16,
        sample_size=_SAMPLE_SIZE * 2,
        scaling_factor=0.13025,
    )


def _scheduler() -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
