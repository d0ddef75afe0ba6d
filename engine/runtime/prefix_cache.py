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

**Shared leading tokens.** A new prefix whose leading tokens a cached one holds (a k-shot header
under many questions, a system prompt under many queries, a question under each of its choices)
takes them from that one, its *lender*, instead of prefilling them: it borrows the lender's
whole pages that hold only shared tokens, and the shared tokens of the next page are copied into
a page of its own (a device copy of their K/V, every layer, in the call that carries its first
chunk: `CachedPrefix.copied`); its prefill starts after them. A token's K/V depend only on the
tokens up to it, so a copy is the same bits as a prefill. Any cached prefix lends, a borrower
too (its pages are partly its lender's: lending chains); the lender is found through chained
hashes of each prefix's 16-token blocks (checked against the tokens themselves), the one that
shares the most. A lender is kept while anything borrows from it (never evicted, never dropped);
it stays writable as any prefix: when its pages are rewritten (a failed call), every borrower
is rewritten too (what it copied or computed over them is untrusted; its epoch moves), and the
borrowers' next work prefills what their lenders miss first (engine/loop/batcher.py). A
borrower never writes a borrowed page.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

from prefixscore.engine.runtime.buckets import ceil_div


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
    prefill is chunked; later calls read what earlier ones wrote). A borrower's first `shared`
    tokens sit in its `lender`'s first `lent` pages (written once the lender holds them); its
    tokens `shared` .. `copied` - 1 are copied from the lender's pages into its own; its own
    `written` starts at `shared`, and its copy takes it to `copied`."""

    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    written: int = 0
    pins: int = 0
    # bumped when a failed call may have left its pages wrong (rewrite): results of calls
    # launched before that, which read the old pages, are not trusted
    epoch: int = 0
    lender: CachedPrefix | None = None
    lent: int = 0  # leading pages that are the lender's
    shared: int = 0  # the tokens they hold
    copied: int = 0  # shared .. copied - 1: copied from the lender (shared when nothing is)
    borrowers: dict[int, CachedPrefix] = dataclasses.field(default_factory=dict)  # id -> borrower
    borrowers_in_use: int = 0  # borrowers pinned, or lending to one in use
    block_keys: tuple[int, ...] = ()  # its chained block hashes (its keys in the cache's index)

    @property
    def ready(self) -> bool:
        return self.holds(len(self.tokens))

    def holds(self, end: int) -> bool:
        """Whether launched calls write tokens 0 .. end - 1: its own, and its lenders' (a chain)."""
        entry: CachedPrefix | None = self
        while entry is not None and end > 0:
            if end > entry.shared and entry.written < end:
                return False
            end, entry = min(end, entry.shared), entry.lender
        return True

    @property
    def in_use(self) -> bool:
        """Pinned, or lending to a prefix in use: its pages are not free (see PrefixCache.usage)."""
        return self.pins > 0 or self.borrowers_in_use > 0

    @property
    def depth(self) -> int:
        """Lenders above it (0: it borrows nothing)."""
        n, lender = 0, self.lender
        while lender is not None:
            n, lender = n + 1, lender.lender
        return n

    @property
    def own_pages(self) -> tuple[int, ...]:
        """The pages this prefix took (a borrower's after the lender's)."""
        return self.pages[self.lent :]


# the most tokens of a block of the lender index (a page's, when smaller): a lender is found by
# the blocks it shares, then extended token by token
BLOCK_TOKENS = 16


def block_keys(tokens: tuple[int, ...], block: int) -> list[int]:
    """The chained hash of each whole block of `tokens`: key k names tokens[: (k + 1) * block]."""
    keys, key = [], 0
    for start in range(0, len(tokens) - block + 1, block):
        key = hash((key, tokens[start : start + block]))
        keys.append(key)
    return keys


class PrefixCache:
    """See the module doc. pages: the pool's page count; page_tokens: tokens per page.

    Every operation is O(pages it moves), never O(cached prefixes): a server under many
    small requests holds thousands of cached prefixes, and the device worker updates the
    cache's gauges at every request. Unpinned, complete prefixes that lend nothing wait in
    `_idle`, least recently released first (the eviction order); `_pinned` counts the held ones.
    """

    def __init__(
        self, pages: int, page_tokens: int, page_bytes: int, on_evict: Callable[[int], None] | None = None
    ) -> None:
        self.total_pages = pages
        self.page_tokens = page_tokens
        self.page_bytes = page_bytes
        self.block = min(BLOCK_TOKENS, page_tokens)
        self.on_evict = on_evict  # called with the bytes an eviction frees
        self._free: list[int] = list(range(pages - 1, -1, -1))
        self._entries: dict[tuple[int, ...], CachedPrefix] = {}
        self._idle: collections.OrderedDict[tuple[int, ...], CachedPrefix] = collections.OrderedDict()
        self._idle_pages = 0  # own pages of the idle prefixes: what eviction can free
        self._pinned = 0  # cached prefixes with pins > 0
        self._used_pages = 0  # own pages of the prefixes in use
        self._holders: dict[int, CachedPrefix] = {}  # chained block hash -> the first cached prefix holding it
        self._unlisted: dict[int, CachedPrefix] = {}  # id -> a fresh entry beside a cached one (acquire)
        self.evictions = 0
        self._lock = threading.RLock()

    def pages_for(self, tokens: int) -> int:
        return ceil_div(tokens, self.page_tokens)

    def acquire(self, tokens: tuple[int, ...], fresh_from: int | None = None) -> tuple[CachedPrefix, bool]:
        """The prefix's entry, pinned; (entry, hit). On a miss it takes the leading tokens a cached
        prefix holds (at most all but its last: see _lender) from that one, its other pages are
        taken (evicting unpinned prefixes, least recently released first), and the prefill of the
        rest is still to run. Raises PoolExhausted when the pages cannot be had.

        `fresh_from`: the prefill must compute the tokens from there on (their rows are read as it
        runs): it borrows at most the tokens before, and a prefix cached already gets a fresh entry
        of its own beside it, out of the index (nothing finds it, it lends nothing), dropped when
        released."""
        with self._lock:
            entry = self._entries.get(tokens)
            if entry is not None and fresh_from is None:
                self._hold(entry)
                return entry, True
            listed = entry is None
            keys = block_keys(tokens, self.block)
            lender, shared = self._lender(tokens, keys, fresh_from)
            entry = CachedPrefix(tokens, ())
            lent = shared // self.page_tokens
            if lender is not None:  # held before room is made: eviction must not take it
                self._lend(lender, entry, lent, shared)
            try:
                needed = self.pages_for(len(tokens)) - lent
                self._make_room(needed)
            except PoolExhausted:
                if lender is not None:
                    self._unlend(entry)
                raise
            entry.pages = (lender.pages[:lent] if lender is not None else ()) + tuple(
                self._free.pop() for _ in range(needed)
            )
            if not listed:
                self._unlisted[id(entry)] = entry
                self._hold(entry)
                return entry, False
            entry.block_keys = tuple(keys)
            # it lends in turn. A block's first holder stays its index entry (the prefix that
            # computed it, or an older one): a lender is then the shallowest, and a chain of
            # borrowers stays as deep as its prompts nest, not one link per prefix that came
            for key in keys:
                self._holders.setdefault(key, entry)
            self._entries[tokens] = entry
            self._hold(entry)
            return entry, False

    def _lender(
        self, tokens: tuple[int, ...], keys: list[int], most: int | None = None
    ) -> tuple[CachedPrefix | None, int]:
        """The cached prefix sharing the most leading tokens with `tokens` (found by whole blocks,
        then extended token by token), and how many it shares, at most all but the last token (and
        at most `most`): a prefix's copy rides with its first chunk, in a call with a prefill
        region (engine/loop/batcher.py). None when it would share less than a block."""
        most = len(tokens) - 1 if most is None else min(most, len(tokens) - 1)
        for k in range(min(len(keys), most // self.block), 0, -1):
            lender = self._holders.get(keys[k - 1])
            n = k * self.block
            if lender is None or not self._cached(lender) or lender.tokens[:n] != tokens[:n]:
                continue
            limit = min(most, len(lender.tokens))
            while n < limit and lender.tokens[n] == tokens[n]:
                n += 1
            return lender, n
        return None, 0

    def _lend(self, lender: CachedPrefix, entry: CachedPrefix, pages: int, shared: int) -> None:
        if not lender.borrowers and lender.pins == 0 and self._idle.pop(lender.tokens, None) is not None:
            self._idle_pages -= len(lender.own_pages)
        lender.borrowers[id(entry)] = entry
        entry.lender, entry.lent = lender, pages
        entry.shared = entry.written = pages * self.page_tokens
        entry.copied = shared

    def _unlend(self, entry: CachedPrefix) -> None:
        """The borrower is gone: its lender may go idle (or, never completed, away)."""
        lender = entry.lender
        assert lender is not None
        del lender.borrowers[id(entry)]
        entry.lender = None
        if not lender.borrowers and lender.pins == 0:
            self._settle(lender)

    def _settle(self, entry: CachedPrefix) -> None:
        """An entry nobody holds or borrows from any more: idle if complete and cached, else dropped."""
        if not entry.ready or not self._cached(entry):
            self._drop(entry)
        else:
            self._idle[entry.tokens] = entry
            self._idle_pages += len(entry.own_pages)

    def pin(self, entry: CachedPrefix) -> None:
        """One more holder of an entry already acquired."""
        with self._lock:
            self._hold(entry)

    def release(self, entry: CachedPrefix) -> None:
        """Unpin. A prefix nobody waits for any more is dropped at once if its prefill never
        finished (or a call writing it failed since: rewrite); a complete one stays cached. A
        lender stays as it is while something borrows from it."""
        with self._lock:
            was = entry.in_use
            entry.pins -= 1
            self._in_use_changed(entry, was)
            if entry.pins != 0:
                return
            if self._cached(entry):
                self._pinned -= 1
            if not entry.borrowers:
                self._settle(entry)

    def rewrite(self, entry: CachedPrefix) -> None:
        """A call that wrote (or, the pool lost, read) this prefix failed: its pages may hold
        garbage. It is prefilled again from its first own token by the next calls that need it,
        and so is every borrower in use (what it copied from its pages or computed over them is
        untrusted too, and so are its results read since); an idle borrower is dropped."""
        with self._lock:
            stack = [entry]
            while stack:
                rewritten = stack.pop()
                if rewritten is not entry and self._idle.get(rewritten.tokens) is rewritten:
                    self._drop(rewritten)
                    continue
                rewritten.written = rewritten.shared
                rewritten.epoch += 1
                stack.extend(list(rewritten.borrowers.values()))

    def rewrite_all(self) -> None:
        """The whole pool was lost (a failed call consumed it): prefixes in use, and what they
        borrow from, are prefilled again; idle ones are dropped."""
        with self._lock:
            entries = [*self._entries.values(), *self._unlisted.values()]
            for entry in sorted(entries, key=lambda e: e.depth, reverse=True):  # borrowers before their lenders
                if entry.pins > 0 or entry.borrowers:
                    self.rewrite(entry)
                elif self._cached(entry):
                    self._drop(entry)

    def _cached(self, entry: CachedPrefix) -> bool:
        return self._entries.get(entry.tokens) is entry

    def _in_use_changed(self, entry: CachedPrefix, was: bool) -> None:
        """After the entry's pins changed (it was in use or not): its pages' count, and its
        lenders' up the chain while their own state changes with it."""
        lender: CachedPrefix | None = entry
        while lender is not None and lender.in_use != was:
            step = 1 if lender.in_use else -1
            self._used_pages += step * len(lender.own_pages)
            if lender.lender is not None:
                was = lender.lender.in_use
                lender.lender.borrowers_in_use += step
            lender = lender.lender

    def _hold(self, entry: CachedPrefix) -> None:
        was = entry.in_use
        entry.pins += 1
        self._in_use_changed(entry, was)
        if entry.pins == 1 and self._cached(entry):
            self._pinned += 1
            if self._idle.pop(entry.tokens, None) is not None:
                self._idle_pages -= len(entry.own_pages)

    def _uncache(self, entry: CachedPrefix) -> None:
        """Out of the book (its pages are the caller's business)."""
        del self._entries[entry.tokens]
        for key in entry.block_keys:
            if self._holders.get(key) is entry:
                del self._holders[key]
        if entry.pins > 0:
            self._pinned -= 1
        elif self._idle.pop(entry.tokens, None) is not None:
            self._idle_pages -= len(entry.own_pages)

    def _drop(self, entry: CachedPrefix) -> None:
        assert not entry.borrowers, "a lender is dropped only once nothing borrows from it"
        if self._cached(entry):
            self._uncache(entry)
        self._unlisted.pop(id(entry), None)
        self._free.extend(entry.own_pages)
        entry.pages = ()
        if entry.lender is not None:
            self._unlend(entry)

    def _reclaimable(self) -> int:
        """Pages eviction could free: the idle prefixes' own, and those of the lenders that
        evicting their (idle) borrowers would free in turn (left idle, or dropped incomplete), up
        each chain."""
        freeable: dict[int, bool] = {}

        def can_free(entry: CachedPrefix) -> bool:
            if id(entry) not in freeable:
                if entry.pins or not entry.borrowers:
                    freeable[id(entry)] = not entry.pins and self._idle.get(entry.tokens) is entry
                else:
                    freeable[id(entry)] = all(can_free(b) for b in entry.borrowers.values())
            return freeable[id(entry)]

        pages, counted = 0, set()
        for idle in self._idle.values():
            entry: CachedPrefix | None = idle
            while entry is not None and id(entry) not in counted and can_free(entry):
                counted.add(id(entry))
                pages += len(entry.own_pages)
                entry = entry.lender
        return pages

    def _make_room(self, needed: int) -> None:
        if needed <= len(self._free):
            return
        if needed > len(self._free) + self._idle_pages:  # the cascade is counted only then: O(idle)
            available = len(self._free) + self._reclaimable()
            if needed > available:
                raise PoolExhausted(needed, available, self.total_pages)
        while needed > len(self._free):  # least recently released first
            self._evict(next(iter(self._idle.values())))

    def _evict(self, entry: CachedPrefix) -> None:
        size = len(entry.own_pages) * self.page_bytes
        self._drop(entry)
        self.evictions += 1
        if self.on_evict:
            self.on_evict(size)

    def evict_idle(self) -> None:
        """Evict every prefix nobody holds (and, once their borrowers are gone, the lenders they
        held): the bench starts each mode of a workload from a cold cache."""
        with self._lock:
            while self._idle:
                self._evict(next(iter(self._idle.values())))

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
        """The share of the pool's pages held by prefixes in use (0-1): pinned, or lending to one in
        use. Idle cached prefixes, and lenders to idle ones only, count as free: eviction gives their
        pages to the next query that needs them."""
        with self._lock:
            return self._used_pages / max(1, self.total_pages)

    @property
    def bytes(self) -> int:
        """Device bytes of the pages held by cached prefixes."""
        return (self.total_pages - len(self._free)) * self.page_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return tokens in self._entries
