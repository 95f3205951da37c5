"""An offline Qwen3 tokenizer and tiny Qwen3 text encoders (FLUX.2 [klein], Z-Image, Ovis-Image).

Qwen3 shares Qwen2's byte-level BPE and ChatML tokens and adds `<think>`/`</think>`; the
pipelines template prompts with `apply_chat_template(..., enable_thinking=...)`, so the chat
template keeps that switch: with thinking disabled the assistant turn starts with an empty
think block, as Qwen3's own template writes it.
"""

from __future__ import annotations

import torch
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from pipelines.tiny.tokenizers import qwen2_tokenizer

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
# Width of the tiny encoders' hidden states.
TEXT_DIM = 16


def qwen3_tokenizer(text: str = "") -> Qwen2Tokenizer:
    """Qwen2's tiny BPE (keeping `text` and CORPUS words whole) with Qwen3's think tokens and
    chat template."""
    tokenizer = qwen2_tokenizer(f"user assistant {text}")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def qwen3_config(tokenizer: Qwen2Tokenizer, layers: int) -> Qwen3Config:
    vocab = tokenizer.get_vocab()
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,  # Grouped-query attention, as Qwen3's.
        head_dim=8,
        max_position_embeddings=2048,
        bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        tie_word_embeddings=True,
    )


def qwen3_causal_lm(tokenizer: Qwen2Tokenizer, layers: int) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(qwen3_config(tokenizer, layers)).eval()


def qwen3_model(tokenizer: Qwen2Tokenizer, layers: int) -> Qwen3Model:
    torch.manual_seed(0)
    return Qwen3Model(qwen3_config(tokenizer, layers)).eval()
