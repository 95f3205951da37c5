"""The Stable Diffusion family's trainer: UNet and CLIP text encoder over the frozen
autoencoder, as a `StableDiffusionPipeline`.

v-prediction on a zero-terminal-SNR schedule sampled with DDIM's trailing timesteps:
with Stable Diffusion's stock schedule the noisiest training input still holds ~7% of the
picture, so a model learns to read the background colour from the noise's own low
frequencies and ignores the caption when sampling starts from pure noise (the chance-level
colours of the first probe). Captions are dropped 10% of the time for classifier-free
guidance.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline
from torch import nn

from pipelines.trained.components import MAX_TOKENS, build_text_encoder, build_tokenizer, build_unet

TRAIN_TIMESTEPS = 1000
SCHEDULE = {
    "num_train_timesteps": TRAIN_TIMESTEPS,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "timestep_spacing": "trailing",
    "clip_sample": False,
    "steps_offset": 1,  # No effect with trailing timesteps; StableDiffusionPipeline warns without it.
}


class SDTrainer:
    """Holds the trainable parts and computes one batch's loss."""

    def __init__(self, vae: AutoencoderKL, seed: int) -> None:
        self.vae = vae
        self.tokenizer = build_tokenizer()
        self.text_encoder = build_text_encoder(self.tokenizer, seed)
        self.unet = build_unet(seed)
        self.noise_schedule = DDPMScheduler(**SCHEDULE)

    def modules(self) -> dict[str, nn.Module]:
        return {"text_encoder": self.text_encoder, "unet": self.unet}

    def encode_text(self, captions: list[str]) -> torch.Tensor:
        """As StableDiffusionPipeline.encode_prompt does: padded to 77, last hidden state."""
        ids = self.tokenizer(
            captions, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
        ).input_ids
        states: torch.Tensor = self.text_encoder(ids)[0]
        return states

    def loss(self, latents: torch.Tensor, captions: list[str], generator: torch.Generator) -> torch.Tensor:
        batch = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(0, TRAIN_TIMESTEPS, (batch,), generator=generator)
        noisy = self.noise_schedule.add_noise(latents, noise, timesteps)
        target = self.noise_schedule.get_velocity(latents, noise, timesteps)
        predicted = self.unet(noisy, timesteps, encoder_hidden_states=self.encode_text(captions)).sample
        return torch.nn.functional.mse_loss(predicted, target)

    def pipeline(self) -> StableDiffusionPipeline:
        return StableDiffusionPipeline(
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            unet=self.unet,
            scheduler=DDIMScheduler(**SCHEDULE, set_alpha_to_one=True),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
