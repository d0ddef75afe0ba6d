"""Prefix cache: query token ids -> the query's KV on the device, LRU under a byte budget.

Entries can be pinned (an open ScoreStream holds its query's KV); pinned entries
are never evicted and count towards the bytes. Thread-safe.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")
Key = tuple[int, ...]


class PrefixCache(Generic[V]):
    def __init__(self, max_bytes: int, size_of: Callable[[V], int], on_evict: Callable[[int], None] | None = None):
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._on_evict = on_evict
        self._entries: collections.OrderedDict[Key, V] = collections.OrderedDict()
        self._pins: collections.Counter[Key] = collections.Counter()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: Key) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: Key, value: V) -> None:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = value
            self.bytes += self._size_of(value)
            self._evict()

    def pin(self, key: Key) -> None:
        with self._lock:
            self._pins[key] += 1

    def unpin(self, key: Key) -> None:
        with self._lock:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]
            self._evict()

    def _evict(self) -> None:
        """Drop least recently used unpinned entries until within budget (lock held)."""
        for key in list(self._entries):
            if self.bytes <= self.max_bytes:
                break
            if self._pins.get(key):
                continue
            value = self._entries.pop(key)
            size = self._size_of(value)
            self.bytes -= size
            self.evictions += 1
            if self._on_evict:
                self._on_evict(size)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries
