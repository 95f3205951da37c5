"""A small, deterministic byte-level BPE trainer for the embedded tiny models.

The `tokenizers` library's trainers break ties differently from run to run, so a tiny
model built with them would differ between processes. This routine breaks ties by the
pair's text, so the same corpus always gives the same vocabulary and merges.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from itertools import pairwise

# A fixed corpus of prompt-like words; its only job is to give the merges something to learn.
CORPUS = (
    "a photo of a cat sitting on a red chair in the sun, an astronaut riding a horse on the "
    "moon, a watercolor painting of a mountain lake at dawn, portrait of an old man with a "
    "beard, highly detailed, sharp focus, cinematic lighting, a bowl of fruit on a wooden "
    "table, city street at night with neon signs and rain, a dog running through a field of "
    "flowers, studio photograph of a vintage camera, the quick brown fox jumps over the lazy "
    "dog, a castle on a hill under a starry sky, oil painting, trending, beautiful, landscape"
)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))


def train_merges(
    num_merges: int | None, end_of_word: str = "", corpus: str = CORPUS
) -> list[tuple[str, str]]:
    """Learn `num_merges` BPE merges from `corpus` (all of them, until every word is one
    symbol, if None); ties go to the smallest pair."""
    byte_map = bytes_to_unicode()
    words: Counter[tuple[str, ...]] = Counter()
    for word in corpus.replace(",", " ").split():
        chars = [byte_map[b] for b in word.encode("utf-8")]
        chars[-1] += end_of_word
        words[tuple(chars)] += 1
    return learn_merges(words, num_merges)


def learn_merges(words: Counter[tuple[str, ...]], max_merges: int | None = None) -> list[tuple[str, str]]:
    """BPE merges learned from `words` (symbol sequences with their counts), at most
    `max_merges`, else until every word is one symbol; ties go to the smallest pair."""
    merges: list[tuple[str, str]] = []
    while max_merges is None or len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = Counter({merge_pair(symbols, best): count for symbols, count in words.items()})
    return merges


def merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """`symbols` with every adjacent occurrence of `pair` joined into one symbol."""
    merged: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return tuple(merged)


def clip_vocab(
    num_merges: int | None = 200, corpus: str = CORPUS
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP-style vocabulary (word-final symbols end in `</w>`) and its merges."""
    merges = train_merges(num_merges, end_of_word="</w>", corpus=corpus)
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols]
    tokens += ["".join(pair) for pair in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, merges
