"""The trained models' parts, built with fixed seeds before training: the autoencoder
(diffusers' `AutoencoderKL`), the offline tokenizer fitted to the captions' words, the
CLIP text encoder, and each family's denoiser.

Sizes are chosen for a 2-core CPU: 64x64 pictures become 16x16x4 latents, so a training
step of the UNet at batch 16 takes ~0.36 s on one idle core.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from pipelines.tiny.bpe import CORPUS, clip_vocab
from pipelines.trained.captions import vocabulary_text
from pipelines.trained.dataset import IMAGE_SIZE

LATENT_CHANNELS = 4
# Three blocks: the autoencoder halves each side twice (64 -> 16).
LATENT_SIZE = IMAGE_SIZE // 4
TEXT_DIM = 64
MAX_TOKENS = 77


def build_tokenizer() -> CLIPTokenizer:
    """The project's offline CLIP-style BPE, its merges learned until every caption word
    (and every word of the tiny models' corpus) is one token."""
    vocab, merges = clip_vocab(num_merges=None, corpus=f"{CORPUS} {vocabulary_text()}")
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)


def build_text_encoder(tokenizer: CLIPTokenizer, seed: int) -> CLIPTextModel:
    """A 2-layer, 64-wide CLIP text encoder over `tokenizer`, trained with the denoiser."""
    vocab = tokenizer.get_vocab()
    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=TEXT_DIM,
        intermediate_size=2 * TEXT_DIM,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=MAX_TOKENS,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        attention_dropout=0.0,
        dropout=0.0,
    )
    return CLIPTextModel(config)


def build_autoencoder(seed: int) -> AutoencoderKL:
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32, 64),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        # Flat-colour shapes need no attention in the autoencoder; it would only cost time.
        mid_block_add_attention=False,
    )


def build_unet(seed: int) -> UNet2DConditionModel:
    """Stable Diffusion's UNet over 16x16 latents, about 1M parameters. Cross-attention on
    the caption's tokens at 8x8 places the shapes; `addition_embed_type="text"` adds an
    attention-pooled caption to the time embedding, so every block is modulated by the
    caption (colours are global facts)."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=LATENT_SIZE,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_DIM,
        attention_head_dim=2,  # Diffusers reads this as the number of heads (of 32 channels).
        norm_num_groups=16,
        addition_embed_type="text",
        addition_embed_type_num_heads=4,
    )
