"""An offline, deterministic Gemma tokenizer for the tiny models that use a Gemma text encoder.

Gemma's tokenizer is a SentencePiece-style BPE over the whole text (spaces become "▁", no
pre-tokenization) that falls back to byte tokens `<0x00>`..`<0xFF>` for anything it cannot
spell. This one keeps that shape with a small vocabulary: Gemma's five special tokens at their
ids (pad 0, eos 1, bos 2, unk 3, mask 4), the 256 byte tokens, printable ASCII, and merges learned
from CORPUS with ties broken by the pair's text, so every build gives the same files.
"""

from __future__ import annotations

from collections import Counter

from transformers import GemmaTokenizer

from pipelines.tiny.bpe import CORPUS, learn_merges

# SentencePiece's word-boundary marker; Gemma's normalizer turns every space into it.
_BOUNDARY = "▁"
# Gemma's special tokens in the order of their ids.
_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")


def _corpus_merges() -> list[tuple[str, str]]:
    """Merges learned from CORPUS until no pair is left: each corpus word becomes one token.

    Words are learned with and without the boundary marker: Gemma adds no dummy prefix, so a
    prompt's first word reaches the BPE without one.
    """
    words: Counter[tuple[str, ...]] = Counter()
    for word in CORPUS.replace(",", " ").split():
        words[tuple(_BOUNDARY + word)] += 1
        words[tuple(word)] += 1
    return learn_merges(words)


def gemma_tokenizer(max_length: int = 1024) -> GemmaTokenizer:
    """A Gemma tokenizer that keeps CORPUS words whole and spells or byte-encodes anything else.

    It prepends `<bos>` like Gemma's own (LTX2Pipeline relies on the tokenizer for it): without
    it the default negative prompt, "", is all padding, and its text embeddings come out all zero.
    `save_pretrained` keeps that in tokenizer.json's post-processor, not in tokenizer_config.json,
    so a reloaded tokenizer still adds `<bos>` although its `add_bos_token` attribute reads False.
    """
    merges = _corpus_merges()
    tokens = [
        *_SPECIAL_TOKENS,
        *(f"<0x{byte:02X}>" for byte in range(256)),
        _BOUNDARY,
        *(chr(c) for c in range(ord("!"), ord("~") + 1)),
        *("".join(pair) for pair in merges),
    ]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=max_length,
    )
