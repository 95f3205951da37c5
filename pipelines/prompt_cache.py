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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from engine.request import LoraRef
from pipelines.byte_lru import ByteLRU
from pipelines.prompt_rows import EncodeCall, Entry, assemble, split_rows


@dataclass
class PromptCache:
    """An LRU of encoded texts, bounded in bytes. Thread-safe: prepare and request-level
    forwards may run on different threads of one worker."""

    capacity_bytes: int
    hits: int = 0
    misses: int = 0
    encode_seconds: float = 0.0
    _lru: ByteLRU[Hashable, Entry] = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._lru = ByteLRU(self.capacity_bytes)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    @property
    def evictions(self) -> int:
        return self._lru.evictions

    def get(self, key: Hashable) -> Entry | None:
        with self._lock:
            return self._lru.get(key)

    def put(self, key: Hashable, entry: Entry) -> None:
        with self._lock:
            self._lru.put(key, entry)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def counts(self) -> dict[str, float]:
        """Cumulative counts for `/metrics` (the adapter's `prompt_cache_counts()`)."""
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "encode_seconds": self.encode_seconds,
                "bytes": self.nbytes,
                "entries": len(self._lru),
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
        call = EncodeCall.of(self.signature, args, kwargs)
        if call is None or scope is UNCACHEABLE:
            return self.original(*args, **kwargs)
        keys: list[Hashable] = [(scope, call.key, texts) for texts in call.row_texts]
        unique = list(dict.fromkeys(keys))
        found: dict[Hashable, Entry | None] = {key: self.cache.get(key) for key in unique}
        missing = [key for key in unique if found[key] is None]
        if missing and not self.apart:
            missing = unique
        if missing:
            found.update(self._encode(call, [keys.index(key) for key in missing], missing))
        assembled = assemble([found[key] for key in keys])
        if assembled is not None:
            self.cache.hits += len(keys) - len(missing)
            return assembled
        if len(missing) < len(unique):
            # Texts encoded in different calls that do not fit together (lengths padded to
            # each call's longest text, a mask dropped where all ones: Qwen-Image): from now
            # on a call with any text missing encodes all of its texts together.
            self.apart = False
            found.update(self._encode(call, [keys.index(key) for key in unique], unique))
            assembled = assemble([found[key] for key in keys])
        # Rows of one call always fit; should they not, the call as if uncached.
        return assembled if assembled is not None else self._timed(call.arguments, len(keys))

    def _encode(self, call: EncodeCall, rows: list[int], keys: list[Hashable]) -> dict[Hashable, Entry]:
        """Encode the texts of `rows` in one call of the original; store each text's rows."""
        outputs = self._timed(call.subset(rows), len(rows))
        single = not isinstance(outputs, tuple)
        entries = split_rows(outputs if not single else (outputs,), len(rows), call.per_text, self.shared)
        result = {}
        for key, (pieces, nbytes) in zip(keys, entries, strict=True):
            entry = Entry(pieces, single, nbytes)
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
