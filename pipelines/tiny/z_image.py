"""Builder of `tiny-z-image`: a ZImagePipeline with small random weights.

Z-Image is a single-stream DiT (ZImageTransformer2DModel): image and caption tokens each pass
their own refiner blocks (the image's modulated by the timestep, the caption's not), then share
the main blocks; RoPE runs over three axes (caption position / frame, height, width), and every
token sequence is padded to a multiple of 32. Its caption features are the second-to-last hidden
state of a Qwen3 model, and its VAE is FLUX.1's (16 latent channels, scaling and shift factors).
ZImageImg2ImgPipeline and ZImageInpaintPipeline take the same five components, so this
directory serves all three (`from_pipe`). This VAE halves each side (FLUX.1's divides by 8), so
64x64 images come from 32x32 latents, 16x16 tokens after the transformer's 2x2 patches. Plain
random weights moved pixels by about 0.3 for another prompt but by 2/255 for guidance +0.5;
sharper keys in the main blocks (where the image meets the caption) and a stronger final
projection bring guidance to 18/255 (issue 47, `pipelines.tiny.gains`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

from pipelines.tiny.flux import LATENT_CHANNELS, flux1_vae
from pipelines.tiny.gains import scale, scale_each
from pipelines.tiny.qwen3 import TEXT_DIM, qwen3_model, qwen3_tokenizer


def build_tiny_z_image(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    tokenizer = qwen3_tokenizer()
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Z-Image-Turbo's: a fixed shift.
        vae=flux1_vae(),
        text_encoder=qwen3_model(tokenizer, layers=2),  # Reads hidden_states[-2].
        tokenizer=tokenizer,
        transformer=z_image_transformer(),
    )
    pipe.save_pretrained(directory, safe_serialization=True)


_KEY_GAIN = 8.0
_OUTPUT_GAIN = 4.0


def z_image_transformer() -> ZImageTransformer2DModel:
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=LATENT_CHANNELS,
        dim=32,
        n_layers=2,  # Z-Image: 30 main blocks, 2 refiner blocks for each stream.
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_DIM,
        axes_dims=[4, 6, 6],  # Sums to the head size, 16 (Z-Image: 32, 48, 48 of 128).
        axes_lens=[1024, 512, 512],
    )
    for block in transformer.layers:
        scale(block.attention.norm_k, _KEY_GAIN)
    scale_each(transformer, "all_final_layer.2-1.linear", _OUTPUT_GAIN)
    return transformer
