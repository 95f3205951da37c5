"""An offline Mistral Small 3.1 tokenizer and text encoder, tiny, for FLUX.2 [dev].

Flux2Pipeline types its `tokenizer` as an `AutoProcessor` (FLUX.2-dev ships a PixtralProcessor:
Mistral's tokenizer plus Pixtral's image processor) but its prompt path only calls
`apply_chat_template(..., tokenize=True)` with text; only caption upsampling with images needs
the image processor. transformers 5 cannot import PixtralProcessor without torchvision (its
module imports it), so the tiny model saves the tokenizer alone, which a plain `from_pretrained`
loads anywhere; the real model's `tokenizer/` folder holds the same tokenizer files, so
`AutoTokenizer.from_pretrained(path, subfolder="tokenizer")` can stand in for its processor on
such hosts. The text encoder is Mistral3ForConditionalGeneration (Mistral text model + Pixtral
vision tower), read at hidden-state layers 10, 20 and 30. So the tiny encoder keeps 30 text
layers (narrow ones) for the stock call to work, and the tokenizer keeps Tekken's shape: a
byte-level BPE with Mistral's control tokens at their real ids (`<s>` 1, `[INST]` 3,
`[IMG]` 10, `<pad>` 11, `[SYSTEM_PROMPT]` 17) and a chat template that writes them.
transformers without `mistral-common` saves and loads it as a plain `TokenizersBackend`.
"""

from __future__ import annotations

from collections import Counter

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen2Tokenizer,
    TokenizersBackend,
)

from pipelines.tiny.bpe import CORPUS, bytes_to_unicode, learn_merges

# Tekken's control tokens at their ids; the gaps are control tokens no pipeline writes.
_CONTROL_TOKENS = {
    0: "<unk>",
    1: "<s>",
    2: "</s>",
    3: "[INST]",
    4: "[/INST]",
    10: "[IMG]",
    11: "<pad>",
    12: "[IMG_BREAK]",
    13: "[IMG_END]",
    17: "[SYSTEM_PROMPT]",
    18: "[/SYSTEM_PROMPT]",
}
_NUM_CONTROL_TOKENS = 20
# Mistral Small 3.1's template, reduced to what Flux2Pipeline sends: a system message, then user
# turns whose content is a list of text and image parts.
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}[/INST]"
    "{% endif %}{% endfor %}"
)
# Text width of the encoder; the transformer's joint input is three layers of it side by side.
TEXT_DIM = 16
# Flux2Pipeline reads hidden states 10, 20 and 30 (text_encoder_out_layers).
_TEXT_LAYERS = 30


def mistral_tokenizer(text: str, max_length: int = 512) -> TokenizersBackend:
    """A byte-level BPE with Mistral's control tokens that keeps every word of `text` and CORPUS whole."""
    pre_tokenizer = Qwen2Tokenizer().backend_tokenizer.pre_tokenizer  # GPT-style split, as Tekken's.
    words: Counter[tuple[str, ...]] = Counter()
    for word, _ in pre_tokenizer.pre_tokenize_str(f"{text} {CORPUS}"):
        words[tuple(word)] += 1
    merges = learn_merges(words)
    controls = [_CONTROL_TOKENS.get(i, f"<SPECIAL_{i}>") for i in range(_NUM_CONTROL_TOKENS)]
    vocab: dict[str, int] = {}
    for token in [*controls, *bytes_to_unicode().values(), *("".join(pair) for pair in merges)]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(controls)
    return TokenizersBackend(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE,
        model_max_length=max_length,
    )


def mistral3_encoder(tokenizer: TokenizersBackend) -> Mistral3ForConditionalGeneration:
    """Mistral3ForConditionalGeneration with 30 narrow text layers and a one-layer Pixtral tower."""
    torch.manual_seed(0)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_DIM,
            "intermediate_size": 32,
            "num_hidden_layers": _TEXT_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,  # Grouped-query attention, as Mistral Small's 32:8.
            "head_dim": 8,
            "max_position_embeddings": 1024,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 11,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "patch_size": 8,
            "image_size": 64,
        },
        image_token_index=10,
        spatial_merge_size=2,
    )
    return Mistral3ForConditionalGeneration(config).eval()
