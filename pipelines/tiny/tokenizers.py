"""Offline, deterministic tokenizers for the tiny models that do not use CLIP's.

T5 (SD3's third text encoder, Flux's second) gets a small SentencePiece-style unigram
vocabulary; Qwen2 (QwenImage's text encoder) a byte-level BPE learned by a routine that breaks ties by the
pair's text, like `pipelines.tiny.bpe`, so every build gives the same files.
"""

from __future__ import annotations

import re
from collections import Counter

from transformers import Qwen2Tokenizer, T5Tokenizer

from pipelines.tiny.bpe import CORPUS, bytes_to_unicode, learn_merges

# SentencePiece's word-boundary marker.
_BOUNDARY = "▁"

# Qwen2's special tokens, in the order they take ids after the learned vocabulary.
QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def t5_tokenizer(max_length: int = 512, extra_words: str = "") -> T5Tokenizer:
    """A T5 tokenizer over a unigram vocabulary: specials, ASCII characters, CORPUS words
    and `extra_words`.

    A whole word scores above any split of it into characters, so known words stay whole;
    any other printable ASCII word is spelt out, and other characters become `<unk>`.
    """
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    words = sorted(set(f"{CORPUS} {extra_words}".replace(",", " ").split()))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (_BOUNDARY, -3.0)]
    pieces += [(_BOUNDARY + c, -6.0) for c in chars]
    pieces += [(c, -6.0) for c in chars]
    pieces += [(_BOUNDARY + w, -5.0) for w in words]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def qwen2_tokenizer(text: str) -> Qwen2Tokenizer:
    """A Qwen2 byte-level BPE that keeps every word of `text` and CORPUS whole.

    Merges are learned from `text` and CORPUS until no pair is left, so those words
    tokenize exactly as Qwen2's own vocabulary would: one token per pre-tokenized word.
    """
    pre_tokenizer = Qwen2Tokenizer().backend_tokenizer.pre_tokenizer
    specials = "|".join(re.escape(token) for token in QWEN2_SPECIAL_TOKENS)
    words: Counter[tuple[str, ...]] = Counter()
    for chunk in re.split(specials, f"{text} {CORPUS}"):
        for word, _ in pre_tokenizer.pre_tokenize_str(chunk):
            words[tuple(word)] += 1
    merges = learn_merges(words)
    tokens = [*bytes_to_unicode().values(), *("".join(pair) for pair in merges), *QWEN2_SPECIAL_TOKENS]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=list(QWEN2_SPECIAL_TOKENS[1:]),  # <|endoftext|> is already eos/pad.
        model_max_length=32768,
    )
