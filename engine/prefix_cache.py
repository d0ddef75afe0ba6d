"""The prefix cache: query token ids -> the pages of the device's prefix pool that hold its KV.

Host bookkeeping only (the pool itself is the engine's device buffer, allocated once):
a free list of page ids and an LRU of cached prefixes. A prefix is acquired (pinned) by
every request or open stream that needs it and released when that is done. Pinned
prefixes, and prefixes still being prefilled, are never evicted; unpinned, complete ones
stay cached, least recently released first out, until their pages are needed. When the
pages a new prefix needs cannot be had, `acquire` raises PoolExhausted: the caller
refuses the work (RESOURCE_EXHAUSTED) instead of the device running out of memory.

Reusing a page is safe as soon as no queued work needs it: device calls run in launch
order, so a call that still reads a page runs before any later call that writes it.
The engine owns one cache for its pool (whoever drives the engine shares it); every
method takes the cache's lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

from prefixscore.engine.buckets import ceil_div


class PoolExhausted(Exception):
    """The pages a prefix needs are all held by prefixes in use."""

    def __init__(self, needed: int, free: int, total: int) -> None:
        if needed > total:
            detail = f"the prefix needs {needed} pages, more than the pool's {total}"
        else:
            detail = f"the prefix needs {needed} pages; {free} of {total} are free or evictable"
        super().__init__(f"prefix pool full: {detail}")
        self.needed = needed


@dataclasses.dataclass(eq=False)
class CachedPrefix:
    """A query's pages in the pool. `written`: tokens whose K/V a launched call writes (the
    prefill is chunked; later calls read what earlier ones wrote)."""

    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    written: int = 0
    pins: int = 0
    # bumped when a failed call may have left its pages wrong (rewrite): results of calls
    # launched before that, which read the old pages, are not trusted
    epoch: int = 0

    @property
    def ready(self) -> bool:
        return self.written >= len(self.tokens)


class PrefixCache:
    """See the module doc. pages: the pool's page count; page_tokens: tokens per page.

    Every operation is O(pages it moves), never O(cached prefixes): a server under many
    small requests holds thousands of cached prefixes, and the device worker updates the
    cache's gauges at every request. Unpinned, complete prefixes wait in `_idle`, least
    recently released first (the eviction order); `_pinned` counts the held ones.
    """

    def __init__(
        self, pages: int, page_tokens: int, page_bytes: int, on_evict: Callable[[int], None] | None = None
    ) -> None:
        self.total_pages = pages
        self.page_tokens = page_tokens
        self.page_bytes = page_bytes
        self.on_evict = on_evict  # called with the bytes an eviction frees
        self._free: list[int] = list(range(pages - 1, -1, -1))
        self._entries: dict[tuple[int, ...], CachedPrefix] = {}
        self._idle: collections.OrderedDict[tuple[int, ...], CachedPrefix] = collections.OrderedDict()
        self._idle_pages = 0  # pages of the idle prefixes: what eviction can free
        self._pinned = 0  # cached prefixes with pins > 0
        self.evictions = 0
        self._lock = threading.RLock()

    def pages_for(self, tokens: int) -> int:
        return ceil_div(tokens, self.page_tokens)

    def acquire(self, tokens: tuple[int, ...]) -> tuple[CachedPrefix, bool]:
        """The prefix's entry, pinned; (entry, hit). On a miss its pages are taken (evicting
        unpinned prefixes, least recently released first) and the prefill is still to run.
        Raises PoolExhausted when the pages cannot be had."""
        with self._lock:
            entry = self._entries.get(tokens)
            if entry is not None:
                self._hold(entry)
                return entry, True
            needed = self.pages_for(len(tokens))
            self._make_room(needed)
            pages = tuple(self._free.pop() for _ in range(needed))
            entry = CachedPrefix(tokens, pages)
            self._entries[tokens] = entry
            self._hold(entry)
            return entry, False

    def pin(self, entry: CachedPrefix) -> None:
        """One more holder of an entry already acquired."""
        with self._lock:
            self._hold(entry)

    def release(self, entry: CachedPrefix) -> None:
        """Unpin. A prefix nobody waits for any more is dropped at once if its prefill never
        finished (or a call writing it failed since: rewrite); a complete one stays cached."""
        with self._lock:
            entry.pins -= 1
            if entry.pins != 0:
                return
            cached = self._cached(entry)
            if cached:
                self._pinned -= 1
            if not entry.ready:
                self._drop(entry)
            elif cached:
                self._idle[entry.tokens] = entry
                self._idle_pages += len(entry.pages)

    def rewrite(self, entry: CachedPrefix) -> None:
        """A call that wrote (or, the pool lost, read) this prefix failed: its pages may hold
        garbage. It is prefilled again from its first token by the next calls that need it."""
        with self._lock:
            entry.written = 0
            entry.epoch += 1

    def rewrite_all(self) -> None:
        """The whole pool was lost (a failed call consumed it): prefixes in use are prefilled
        again, idle ones are dropped."""
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.pins > 0:
                    self.rewrite(entry)
                else:
                    self._drop(entry)

    def _cached(self, entry: CachedPrefix) -> bool:
        return self._entries.get(entry.tokens) is entry

    def _hold(self, entry: CachedPrefix) -> None:
        entry.pins += 1
        if entry.pins == 1 and self._cached(entry):
            self._pinned += 1
            if self._idle.pop(entry.tokens, None) is not None:
                self._idle_pages -= len(entry.pages)

    def _uncache(self, entry: CachedPrefix) -> None:
        """Out of the book (its pages are the caller's business)."""
        del self._entries[entry.tokens]
        if entry.pins > 0:
            self._pinned -= 1
        elif self._idle.pop(entry.tokens, None) is not None:
            self._idle_pages -= len(entry.pages)

    def _drop(self, entry: CachedPrefix) -> None:
        if self._cached(entry):
            self._uncache(entry)
        self._free.extend(entry.pages)
        entry.pages = ()

    def _make_room(self, needed: int) -> None:
        if needed <= len(self._free):
            return
        if needed > len(self._free) + self._idle_pages:
            raise PoolExhausted(needed, len(self._free) + self._idle_pages, self.total_pages)
        while needed > len(self._free):  # least recently released first
            _, entry = next(iter(self._idle.items()))
            size = len(entry.pages) * self.page_bytes
            self._drop(entry)
            self.evictions += 1
            if self.on_evict:
                self.on_evict(size)

    def pins(self, tokens: tuple[int, ...]) -> int:
        """Holders of a cached prefix (0 when it is not cached)."""
        with self._lock:
            entry = self._entries.get(tokens)
            return entry.pins if entry is not None else 0

    @property
    def pinned(self) -> int:
        """Cached prefixes held by someone (an open stream, a queued request): 0 when idle,
        so a leaked pin shows."""
        return self._pinned

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """The share of the pool's pages held by prefixes in use (0-1). Idle cached prefixes
        count as free: eviction gives their pages to the next query that needs them."""
        with self._lock:
            return (self.total_pages - len(self._free) - self._idle_pages) / max(1, self.total_pages)

    @property
    def bytes(self) -> int:
        """Device bytes of the pages held by cached prefixes."""
        return (self.total_pages - len(self._free)) * self.page_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return tokens in self._entries
