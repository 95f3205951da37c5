"""The texts of one `encode_prompt` call and its outputs' rows, for the prompt cache
(`pipelines.prompt_cache`): a call bound to its arguments, split into one key per text
(`EncodeCall`); its outputs split into one `Entry` per text (`split_rows`), and entries put
back together into a call's outputs (`assemble`).
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# The per-row text arguments of diffusers' `encode_prompt`s.
_TEXTS = ("prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3")
# Images per text: each text's rows are consecutive in the outputs (diffusers repeats per prompt).
_PER_TEXT = ("num_images_per_prompt", "num_videos_per_prompt")
# A row count some encoders take beside the prompts (HunyuanVideo 1.5): set for each call.
_BATCH = "batch_size"
# Argument values that may be part of a key.
_PLAIN = (str, int, float, bool, type(None), torch.device, torch.dtype)


@dataclass(frozen=True)
class Entry:
    """One encoded text: for each output of the call a piece, ("rows", its rows), ("list",
    its items of a list output), ("shared", an output every row shares: FLUX's text ids) or
    ("none", None); whether the call returned one output rather than a tuple; its size."""

    pieces: tuple[tuple[str, Any], ...]
    single: bool
    nbytes: int


@dataclass(frozen=True)
class EncodeCall:
    """One `encode_prompt` call, bound: its per-row texts and the rest as a key."""

    arguments: dict[str, Any]
    row_texts: list[tuple[Any, ...]]
    key: Hashable
    per_text: int

    @classmethod
    def of(
        cls, signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> EncodeCall | None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    return None  # only keyword arguments can be called again by name
            elif kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[name] = value
        prompt = arguments.get("prompt")
        count = 1 if isinstance(prompt, str) else len(prompt) if isinstance(prompt, list) else 0
        if count == 0:
            return None
        columns: list[list[Any]] = []
        rest: list[tuple[str, Any]] = []
        for name, value in arguments.items():
            if name in _TEXTS:
                column = _column(value, count)
                if column is None:
                    return None
                columns.append(column)
            elif name != _BATCH:
                if not _plain(value):
                    return None  # embeddings, images: not plain data
                rest.append((name, tuple(value) if isinstance(value, list) else value))
        per_text = next((int(arguments[name]) for name in _PER_TEXT if name in arguments), 1)
        return cls(arguments, list(zip(*columns, strict=True)), tuple(rest), per_text)

    def subset(self, rows: list[int]) -> dict[str, Any]:
        """The arguments for the texts of `rows` only (lists built anew: some encoders write
        their templated prompts back into the list they get)."""
        arguments = dict(self.arguments)
        for name in _TEXTS:
            if isinstance(arguments.get(name), list):
                arguments[name] = [arguments[name][row] for row in rows]
        if _BATCH in arguments:
            arguments[_BATCH] = len(rows)
        return arguments


def _plain(value: Any) -> bool:
    """Whether a value may be part of a key: plain data, or a tuple or list of it (FLUX.2's
    encoder layers, Sana's instruction lines)."""
    if isinstance(value, tuple | list):
        return all(_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def _column(value: Any, count: int) -> list[Any] | None:
    """A text argument as one value per row: a list as it is, a string or None for all."""
    if value is None or isinstance(value, str):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def split_rows(
    outputs: tuple[Any, ...], texts: int, per_text: int, shared: set[int]
) -> list[tuple[tuple[tuple[str, Any], ...], int]]:
    """Each text's pieces (copies: a row must not pin its whole batch, nor see the caller's
    changes) and their size in bytes. An output without one row per image is shared, and
    that position stays shared (it could have one row per image by chance in a later call)."""
    total = texts * per_text
    pieces: list[list[tuple[str, Any]]] = [[] for _ in range(texts)]
    for position, output in enumerate(outputs):
        rows = _rows(output)
        if rows is not None and rows != total:
            shared.add(position)
        for text, own in enumerate(pieces):
            if output is None:
                own.append(("none", None))
            elif rows is None or position in shared:
                own.append(("shared", output.clone() if isinstance(output, torch.Tensor) else output))
            elif isinstance(output, torch.Tensor):
                own.append(("rows", output[text * per_text : (text + 1) * per_text].clone()))
            else:
                own.append(
                    ("list", [item.clone() for item in output[text * per_text : (text + 1) * per_text]])
                )
    return [(tuple(own), sum(_nbytes(value) for _, value in own)) for own in pieces]


def _rows(output: Any) -> int | None:
    if isinstance(output, torch.Tensor) and output.dim() > 0:
        return int(output.shape[0])
    if isinstance(output, list) and all(isinstance(item, torch.Tensor) for item in output):
        return len(output)
    return None


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, list):
        return sum(_nbytes(item) for item in value)
    return 0


def assemble(entries: list[Entry | None]) -> Any:
    """The outputs of a call over these texts, as new tensors; None where the rows do not fit
    together (different lengths, an output None for some texts only)."""
    present = [entry for entry in entries if entry is not None]
    assert len(present) == len(entries)
    first = present[0]
    outputs: list[Any] = []
    for position, (kind, value) in enumerate(first.pieces):
        column = [entry.pieces[position] for entry in present]
        if any(piece[0] != kind for piece in column):
            return None
        values = [piece[1] for piece in column]
        if kind == "rows":
            if any(v.shape[1:] != value.shape[1:] for v in values):
                return None
            outputs.append(torch.cat(values))
        elif kind == "list":
            outputs.append([item.clone() for items in values for item in items])
        elif kind == "shared" and isinstance(value, torch.Tensor):
            if any(v.shape != value.shape for v in values):
                return None
            outputs.append(value.clone())
        else:  # None, or a value of no rows (Z-Image's empty negatives without CFG)
            outputs.append(list(value) if isinstance(value, list) else value)
    return outputs[0] if first.single else tuple(outputs)
