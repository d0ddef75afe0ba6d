"""Pins of queries' pages in the prefix pool: a request's, for its life, and an open stream's,
until the stream closes.

Pages are acquired at once, under the device worker's lock, so a query the pool cannot hold
is refused before it queues (QueueFull, from engine/loop/admission.py), never an out-of-memory
on the device. A pinned query is never evicted; released, it stays cached until its pages
are needed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from prefixscore.engine.loop.admission import Admission
from prefixscore.engine.loop.loop_metrics import LoopMetrics
from prefixscore.engine.loop.request import PrefillOnly, TokenizedRequest
from prefixscore.engine.loop.work_unit import QueryPin, Ticket, WorkUnit
from prefixscore.engine.runtime.prefix_cache import CachedPrefix, PoolExhausted, PrefixCache


@dataclasses.dataclass
class StreamPin:
    """An open stream's hold on its query's pages; `ready` resolves (cached tokens) once the
    query's prefill is launched."""

    entry: CachedPrefix
    ready: concurrent.futures.Future


def _asked_before(entry: CachedPrefix, hit: bool) -> int:
    """The prefix's tokens another request asked for: all of them on a hit; on a miss, the
    leading ones it borrows or copies (their lender computes them, or did)."""
    return len(entry.tokens) if hit else entry.copied


class PagePins:
    """Pins and releases `cache`'s pages for requests and streams; called under the device
    worker's lock."""

    def __init__(self, cache: PrefixCache, admission: Admission, metrics: LoopMetrics) -> None:
        self.cache = cache
        self.admission = admission
        self.metrics = metrics

    def pin_request(self, unit: WorkUnit) -> None:
        """Pin the query `unit` scores its items over (a stream's batch already holds its open's
        entry), and count the tokens it needs computed; raises QueueFull when the pool cannot
        hold it."""
        payload = unit.payload
        if payload.item_first or unit.pin.entry is not None:  # no prefix, or one already asked for
            self.metrics.requested(payload.requested_tokens(len(payload.prefix)))
            return
        entry, hit = self._acquire(payload.prefix, payload.prefix_rows)
        unit.pin.entry = entry
        # its rows come from prefill chunks still to run (a fresh entry): none would come otherwise
        assert payload.prefix_rows is None or entry.written <= payload.prefix_rows
        # a miss may still take leading tokens another query wrote (engine/runtime/prefix_cache.py)
        lent = entry.lender is not None and entry.lender.holds(entry.copied)
        unit.reply.cached_tokens = len(payload.prefix) if hit else entry.copied if lent else 0
        self.metrics.requested(payload.requested_tokens(_asked_before(entry, hit)))
        # one hit or miss per request (or stream open): hit when no new prefill runs for it
        if unit.ticket.counts_lookup:
            self.metrics.lookup(hit)

    def release_request(self, unit: WorkUnit) -> None:
        """Give back the unit's pin on its query's pages, once."""
        pin = unit.pin
        if pin.entry is not None and not pin.released:
            pin.released = True
            self.cache.release(pin.entry)
            self.metrics.cache(self.cache)

    def open_stream(self, prefix: tuple[int, ...], request_id: str = "") -> tuple[StreamPin, WorkUnit | None]:
        """Pin `prefix`'s pages for an open stream (the open's `request_id`: its prefill's, for
        the log should it fail); raises QueueFull when the pool cannot hold it. Returns the pin
        and, for a query not yet prefilled, the unit to queue for its prefill (no items: it is
        done once its query's chunks are launched)."""
        entry, hit = self._acquire(prefix)
        self.metrics.lookup(hit)
        ready: concurrent.futures.Future = concurrent.futures.Future()
        cached = len(prefix) if hit else 0
        self.metrics.requested(len(prefix) - _asked_before(entry, hit))
        if entry.ready:
            ready.set_result(cached)
            return StreamPin(entry, ready), None

        def done(unit: WorkUnit) -> None:
            # the stream may have ended while its prefix was pinned: its wait was cancelled, and
            # with it this future (asyncio.wrap_future); there is no one left to tell
            if not ready.set_running_or_notify_cancel():
                return
            if unit.reply.error is not None:
                ready.set_exception(unit.reply.error)
            else:
                ready.set_result(cached)

        # it holds a pin of its own, so the pages stay its until the prefill is launched even if
        # the stream closes first
        prefill_only = TokenizedRequest(prefix, [], (), PrefillOnly(), False)
        unit = WorkUnit(prefill_only, Ticket(request_id=request_id, counts_lookup=False), pin=QueryPin(entry))
        unit.reply.on_done = done
        self.cache.pin(entry)
        return StreamPin(entry, ready), unit

    def close_stream(self, pin: StreamPin) -> None:
        """Unpin a stream's query (it stays cached until its pages are needed)."""
        self.cache.release(pin.entry)
        self.metrics.cache(self.cache)

    def _acquire(self, prefix: tuple[int, ...], fresh_from: int | None = None) -> tuple[CachedPrefix, bool]:
        """The prefix's pages, pinned, and whether they were cached (`fresh_from`: its prefill must
        compute the tokens from there on, PrefixCache.acquire); QueueFull when the pool cannot hold
        them."""
        try:
            entry, hit = self.cache.acquire(prefix, fresh_from)
        except PoolExhausted as full:
            raise self.admission.pool_full(full, self.cache.total_pages) from full
        self.metrics.cache(self.cache)
        return entry, hit
