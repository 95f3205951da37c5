"""Builders of `tiny-wan22` and `tiny-wan22-i2v`: Wan 2.2 A14B text- and image-to-video with small
random weights.

Wan 2.2 A14B is Wan 2.1 14B's network twice: `transformer` (the high-noise expert) denoises while
the timestep is at least `boundary_ratio` x 1000, `transformer_2` (the low-noise expert) after it,
each with its own guidance scale (`guidance_scale`, `guidance_scale_2`). Both are WanPipeline /
WanImageToVideoPipeline with `transformer_2` and `boundary_ratio` set; the text encoder, VAE
(8x spatial, 4x temporal, 16 channels) and patches are tiny-wan's, so frames are 4k+1 and sides
multiples of 16. The image-to-video model has no CLIP image encoder (Wan 2.1 I2V's is gone): the
input image reaches the experts only as VAE latents of the first frame, with a first-frame mask,
concatenated to the noise (in_channels 16 + 4 + 16 = 36). The two experts are seeded differently,
so a test can tell which one ran.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import WanImageToVideoPipeline, WanPipeline

from pipelines.tiny.tokenizers import t5_tokenizer
from pipelines.tiny.wan import LATENT_CHANNELS, wan_scheduler, wan_text_encoder, wan_transformer, wan_vae

# The published settings of Wan-AI's configs (wan/configs/wan_{t2v,i2v}_A14B.py): the boundary
# between the experts as a fraction of the 1000 training timesteps, and the schedule's shift.
T2V_BOUNDARY_RATIO = 0.875
T2V_FLOW_SHIFT = 12.0
I2V_BOUNDARY_RATIO = 0.9
I2V_FLOW_SHIFT = 5.0
# The image-to-video condition: a 4-channel first-frame mask and the condition video's latents.
_CONDITION_CHANNELS = 4 + LATENT_CHANNELS
# Seeds of the two experts; the high-noise one keeps tiny-wan's.
HIGH_NOISE_SEED = 0
LOW_NOISE_SEED = 1


def build_tiny_wan22(directory: Path) -> None:
    """Build the text-to-video pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)  # The pipeline pads every prompt to 512 tokens.
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=wan_text_encoder(tokenizer),
        transformer=wan_transformer(in_channels=LATENT_CHANNELS, seed=HIGH_NOISE_SEED),
        transformer_2=wan_transformer(in_channels=LATENT_CHANNELS, seed=LOW_NOISE_SEED),
        vae=wan_vae(),
        scheduler=wan_scheduler(flow_shift=T2V_FLOW_SHIFT),
        boundary_ratio=T2V_BOUNDARY_RATIO,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def build_tiny_wan22_i2v(directory: Path) -> None:
    """Build the image-to-video pipeline with fixed seeds and save it to `directory`."""
    tokenizer = t5_tokenizer(max_length=512)
    in_channels = LATENT_CHANNELS + _CONDITION_CHANNELS
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=wan_text_encoder(tokenizer),
        transformer=wan_transformer(in_channels=in_channels, seed=HIGH_NOISE_SEED),
        transformer_2=wan_transformer(in_channels=in_channels, seed=LOW_NOISE_SEED),
        vae=wan_vae(),
        scheduler=wan_scheduler(flow_shift=I2V_FLOW_SHIFT),
        boundary_ratio=I2V_BOUNDARY_RATIO,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
