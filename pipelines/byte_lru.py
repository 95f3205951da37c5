"""`ByteLRU`: a least-recently-used map bounded in bytes, for the prompt-embedding cache
(`pipelines.prompt_cache`) and the result cache (`server.result_cache`). Not thread-safe:
a caller that shares one between threads holds its own lock."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Sized)


class ByteLRU(Generic[K, V]):
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The entry, now the most recently used, or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: K, entry: V) -> None:
        """Keep `entry`, evicting the least recently used until all fit (an entry larger
        than the whole capacity is kept by nobody)."""
        if entry.nbytes > self.capacity_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1

    def clear(self) -> None:
        """Forget every entry (not counted as evictions)."""
        self._entries.clear()
        self.nbytes = 0
