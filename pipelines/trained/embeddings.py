"""Carry a trained text encoder's token embeddings over to a grown tokenizer.

A tokenizer refitted to more words gives tokens new ids (the CLIP merges are relearned, the
T5 pieces are sorted), so a saved embedding table cannot be loaded as it is. Rows move by
token text: a token both tokenizers hold keeps its trained row; a new one starts as its
synonym's row (`SYNONYMS`: "big" as "large") or, failing that, as the mean of the rows of
the pieces the old tokenizer split its text into ("Red" as "red", "picture" as the mean of
"p", "ic", "ture"), so a new word starts near what the trained model already read for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipelines.trained.captions import SYNONYMS


def carry_embeddings(saved: nn.Module, old_tokenizer: Any, new_tokenizer: Any) -> dict[str, torch.Tensor]:
    """`saved`'s state dict with its token embeddings (every tied copy) laid out for
    `new_tokenizer`'s vocabulary; the state dict itself when the vocabularies are equal."""
    state: dict[str, torch.Tensor] = saved.state_dict()
    old_vocab, new_vocab = old_tokenizer.get_vocab(), new_tokenizer.get_vocab()
    if old_vocab == new_vocab:
        return state
    table = saved.get_input_embeddings().weight.detach()  # type: ignore[operator]
    rows = torch.empty(max(new_vocab.values()) + 1, table.shape[1])
    for token, index in new_vocab.items():
        if token in old_vocab:
            rows[index] = table[old_vocab[token]]
        else:
            rows[index] = _starting_row(token, table, old_tokenizer)
    tied = [key for key, value in state.items() if value.data_ptr() == table.data_ptr()]
    return {**state, **dict.fromkeys(tied, rows)}


def _starting_row(token: str, table: torch.Tensor, old_tokenizer: Any) -> torch.Tensor:
    # The token's text without CLIP's end-of-word or SentencePiece's start-of-word marker
    # (caption words are ASCII, which CLIP's byte map leaves as it is).
    text = token.removesuffix("</w>").removeprefix("▁").strip().lower()
    text = SYNONYMS.get(text, text)
    ids = old_tokenizer(text, add_special_tokens=False).input_ids if text else []
    return table[ids].mean(dim=0) if ids else table.mean(dim=0)
