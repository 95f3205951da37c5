"""The FLUX family's trainer: a small `FluxTransformer2DModel`, a CLIP text encoder (its
pooled output modulates every block) and a T5 encoder (its tokens join the attention),
over the same frozen autoencoder as the UNet model, as a `FluxPipeline`.

Rectified flow as FLUX itself: x_t = (1 - s) x_0 + s e, the transformer predicts e - x_0,
s drawn logit-normal (SD3's choice: most steps where the picture takes shape), sampled with
`FlowMatchEulerDiscreteScheduler` from s = 1, pure noise, so nothing of the picture leaks
through the starting point. No guidance embedding (FLUX.1-schnell style): CFG is true CFG
(`true_cfg_scale` with a negative prompt), trained for by 10% caption dropout.

T5 is padded to `T5_TOKENS`, not FluxPipeline's default 512: the pipeline must be called
with `max_sequence_length=T5_TOKENS` (its tokenizer's `model_max_length`).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from torch import nn
from transformers import T5Config, T5EncoderModel

from pipelines.tiny.encoders import t5_config_fields
from pipelines.tiny.tokenizers import t5_tokenizer
from pipelines.trained.captions import vocabulary_text
from pipelines.trained.components import (
    LATENT_CHANNELS,
    LATENT_SIZE,
    MAX_TOKENS,
    TEXT_DIM,
    build_text_encoder,
    build_tokenizer,
)

# Captions are at most ~20 T5 pieces; 32 keeps the joint attention short.
T5_TOKENS = 32
_PACKED_SIDE = LATENT_SIZE // 2


def build_transformer(seed: int) -> FluxTransformer2DModel:
    """Two double-stream and two single-stream blocks, 64 wide (4 heads of 16)."""
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS * 4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # Sums to attention_head_dim.
    )


class FluxTrainer:
    """Holds the trainable parts and computes one batch's loss."""

    def __init__(self, vae: AutoencoderKL, seed: int) -> None:
        if vae.config.shift_factor is None:
            vae.register_to_config(shift_factor=0.0)  # FluxPipeline adds it when decoding.
        self.vae = vae
        self.tokenizer = build_tokenizer()
        self.tokenizer_2 = t5_tokenizer(max_length=T5_TOKENS, extra_words=vocabulary_text(capitals=True))
        self.text_encoder = build_text_encoder(self.tokenizer, seed)
        torch.manual_seed(seed)
        fields = t5_config_fields(self.tokenizer_2, d_model=TEXT_DIM, d_kv=16, d_ff=2 * TEXT_DIM)
        self.text_encoder_2 = T5EncoderModel(T5Config(**fields, dropout_rate=0.0))
        self.transformer = build_transformer(seed)
        self.image_ids = FluxPipeline._prepare_latent_image_ids(
            1, _PACKED_SIDE, _PACKED_SIDE, "cpu", torch.float32
        )
        self.text_ids = torch.zeros(T5_TOKENS, 3)

    def modules(self) -> dict[str, nn.Module]:
        return {
            "text_encoder": self.text_encoder,
            "text_encoder_2": self.text_encoder_2,
            "transformer": self.transformer,
        }

    def encode_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """As FluxPipeline.encode_prompt does: CLIP's pooled output and T5's hidden states."""
        clip_ids = self.tokenizer(
            captions, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
        ).input_ids
        t5_ids = self.tokenizer_2(
            captions, padding="max_length", max_length=T5_TOKENS, truncation=True, return_tensors="pt"
        ).input_ids
        pooled: torch.Tensor = self.text_encoder(clip_ids, output_hidden_states=False).pooler_output
        states: torch.Tensor = self.text_encoder_2(t5_ids, output_hidden_states=False)[0]
        return pooled, states

    def loss(self, latents: torch.Tensor, captions: list[str], generator: torch.Generator) -> torch.Tensor:
        batch = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator)
        sigmas = torch.sigmoid(torch.randn(batch, generator=generator))
        noisy = (1 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
        pooled, states = self.encode_text(captions)
        predicted = self.transformer(
            hidden_states=_pack(noisy),
            timestep=sigmas,
            pooled_projections=pooled,
            encoder_hidden_states=states,
            txt_ids=self.text_ids,
            img_ids=self.image_ids,
            return_dict=False,
        )[0]
        return torch.nn.functional.mse_loss(predicted, _pack(noise - latents))

    def pipeline(self) -> FluxPipeline:
        return FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=self.tokenizer_2,
            transformer=self.transformer,
        )


def _pack(latents: torch.Tensor) -> torch.Tensor:
    batch, channels, height, width = latents.shape
    packed: torch.Tensor = FluxPipeline._pack_latents(latents, batch, channels, height, width)
    return packed
