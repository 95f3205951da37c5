"""The prompt-embedding cache: identical prompts (and negative prompts) go through the text
encoders once while they stay in an LRU bounded in bytes (`--prompt-cache-mb`).

Clients often send one prompt with many seeds. The cache sits on the diffusers pipeline's
own `encode_prompt` (`CachedEncodePrompt`, installed per loaded model by `install`), so one
mechanism serves request level (diffusers' `__call__` calls `self.encode_prompt`) and the
step stages (every family's `encode` calls it too): each call is split into its texts, the
texts already cached are not encoded again, the others are encoded together in one call of
the original, and the rows are put back together in the caller's order.

A text's entry is keyed by the LoRA adapter active (an adapter may change the text encoder),
every other argument of the call (sequence length, CFG, images per prompt, device, dtype...)
and the per-row texts (prompt, prompt_2, negative_prompt, ...). Calls with anything that is
not plain data (precomputed embeddings, input images: the edit pipelines read the image
with the prompt) pass through uncached. The cache never hands out its own tensors: stored
rows are copies, and what a caller gets is a new tensor (`torch.cat`), so a later in-place
change by a step cannot reach it.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.request import LoraRef

# The per-row text arguments of diffusers' `encode_prompt`s.
_TEXTS = ("prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3")
# Images per text: each text's rows are consecutive in the outputs (diffusers repeats per prompt).
_PER_TEXT = ("num_images_per_prompt", "num_videos_per_prompt")
# A row count some encoders take beside the prompts (HunyuanVideo 1.5): set for each call.
_BATCH = "batch_size"
# Argument values that may be part of a key.
_PLAIN = (str, int, float, bool, type(None), torch.device, torch.dtype)


@dataclass(frozen=True)
class _Entry:
    """One encoded text: for each output of the call a piece, ("rows", its rows), ("list",
    its items of a list output), ("shared", an output every row shares: FLUX's text ids) or
    ("none", None); whether the call returned one output rather than a tuple; its size."""

    pieces: tuple[tuple[str, Any], ...]
    single: bool
    nbytes: int


@dataclass
class PromptCache:
    """An LRU of encoded texts, bounded in bytes. Thread-safe: prepare and request-level
    forwards may run on different threads of one worker."""

    capacity_bytes: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    encode_seconds: float = 0.0
    nbytes: int = 0
    _entries: OrderedDict[Hashable, _Entry] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: Hashable) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: _Entry) -> None:
        if entry.nbytes > self.capacity_bytes:
            return  # larger than the whole cache: kept by nobody
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            while self.nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
                self.evictions += 1

    def counts(self) -> dict[str, float]:
        """Cumulative counts for `/metrics` (`engine.forward.prompt_cache_of`)."""
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "encode_seconds": self.encode_seconds,
                "bytes": self.nbytes,
                "entries": len(self._entries),
            }

    def __getstate__(self) -> dict[str, Any]:
        # An adapter's weightless copy crosses processes (`spec()`): it takes no entries.
        return {"capacity_bytes": self.capacity_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity_bytes"])  # type: ignore[misc]


class CachedEncodePrompt:
    """A pipeline's `encode_prompt` through a `PromptCache` (see the module docstring).
    `scope` says what else the embeddings depend on now: the active LoRA adapter, or
    `UNCACHEABLE` while it is not known."""

    def __init__(
        self, original: Callable[..., Any], cache: PromptCache, scope: Callable[[], Hashable]
    ) -> None:
        self.original = original
        self.cache = cache
        self.scope = scope
        self.signature = inspect.signature(original)
        # Output positions seen not to have one row per text (FLUX's text ids): shared.
        self.shared: set[int] = set()
        # Whether texts encoded in different calls fit together (fixed-length encoders):
        # then only the missing texts of a call are encoded.
        self.apart = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        scope = self.scope()
        call = _Call.of(self.signature, args, kwargs)
        if call is None or scope is UNCACHEABLE:
            return self.original(*args, **kwargs)
        keys: list[Hashable] = [(scope, call.key, texts) for texts in call.row_texts]
        unique = list(dict.fromkeys(keys))
        found: dict[Hashable, _Entry | None] = {key: self.cache.get(key) for key in unique}
        missing = [key for key in unique if found[key] is None]
        if missing and not self.apart:
            missing = unique
        if missing:
            found.update(self._encode(call, [keys.index(key) for key in missing], missing))
        assembled = _assemble([found[key] for key in keys])
        if assembled is not None:
            self.cache.hits += len(keys) - len(missing)
            return assembled
        if len(missing) < len(unique):
            # Texts encoded in different calls that do not fit together (lengths padded to
            # each call's longest text, a mask dropped where all ones: Qwen-Image): from now
            # on a call with any text missing encodes all of its texts together.
            self.apart = False
            found.update(self._encode(call, [keys.index(key) for key in unique], unique))
            assembled = _assemble([found[key] for key in keys])
        # Rows of one call always fit; should they not, the call as if uncached.
        return assembled if assembled is not None else self._timed(call.arguments, len(keys))

    def _encode(self, call: _Call, rows: list[int], keys: list[Hashable]) -> dict[Hashable, _Entry]:
        """Encode the texts of `rows` in one call of the original; store each text's rows."""
        outputs = self._timed(call.subset(rows), len(rows))
        single = not isinstance(outputs, tuple)
        entries = _split(outputs if not single else (outputs,), len(rows), call.per_text, self.shared)
        result = {}
        for key, (pieces, nbytes) in zip(keys, entries, strict=True):
            entry = _Entry(pieces, single, nbytes)
            self.cache.put(key, entry)
            result[key] = entry
        return result

    def _timed(self, arguments: dict[str, Any], texts: int) -> Any:
        """The original over `texts` texts, counted as misses, its host time added up."""
        start = time.perf_counter()
        outputs = self.original(**arguments)
        self.cache.encode_seconds += time.perf_counter() - start
        self.cache.misses += texts
        return outputs


# The scope while the active adapter is not known (after a failed LoRA load).
UNCACHEABLE: Hashable = object()


@dataclass(frozen=True)
class _Call:
    """One `encode_prompt` call, bound: its per-row texts and the rest as a key."""

    arguments: dict[str, Any]
    row_texts: list[tuple[Any, ...]]
    key: Hashable
    per_text: int

    @classmethod
    def of(cls, signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]) -> _Call | None:
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


def _split(
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


def _assemble(entries: list[_Entry | None]) -> Any:
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


def install(pipe: Any, capacity_mb: float, scope: Callable[[], Hashable]) -> PromptCache | None:
    """Put `pipe.encode_prompt` behind a cache of `capacity_mb` MiB; None (nothing changed)
    when the capacity is 0 or the pipeline has no `encode_prompt`."""
    original = getattr(pipe, "encode_prompt", None)
    if capacity_mb <= 0 or original is None:
        return None
    cache = PromptCache(int(capacity_mb * 2**20))
    pipe.__dict__["encode_prompt"] = CachedEncodePrompt(original, cache, scope)
    return cache


def lora_scope(active: LoraRef | object | None) -> Hashable:
    """The scope key of the adapter a pipeline runs with: itself, or `UNCACHEABLE` when
    not known (`pipelines.lora.LoraAdapters.active` after a failed load)."""
    return active if active is None or isinstance(active, LoraRef) else UNCACHEABLE
