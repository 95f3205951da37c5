"""Configs of the tiny text encoders several tiny models share (CLIP text, T5/UMT5)."""

from __future__ import annotations

from typing import Any

from transformers import CLIPTextConfig


def clip_text_config(vocab: dict[str, int], projection_dim: int | None = None) -> CLIPTextConfig:
    """A 2-layer, 32-wide CLIP text encoder over `vocab` (a `pipelines.tiny.bpe` vocabulary).

    Two layers, because SDXL and SD3 read the penultimate layer's hidden states.
    `projection_dim` is set only for encoders with a projection (SDXL's second, SD3's).
    """
    extra = {} if projection_dim is None else {"projection_dim": projection_dim}
    return CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=77,
        **extra,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )


def t5_config_fields(tokenizer: Any, d_model: int = 32, d_kv: int = 8, d_ff: int = 64) -> dict[str, Any]:
    """Fields of a 2-layer T5 encoder over `tokenizer`, for `T5Config` or `UMT5Config`."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": d_model,
        "d_kv": d_kv,
        "d_ff": d_ff,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "feed_forward_proj": "gated-gelu",
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }
