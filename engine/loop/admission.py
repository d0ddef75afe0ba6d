"""Admission control: work the device loop refuses before it queues, with a retry hint.

A request is refused (QueueFull: RESOURCE_EXHAUSTED to the client) when the queue already
holds `max_items` items or `max_tokens` item tokens, or when the prefix pool cannot hold its
query (engine/loop/page_pins.py asks for that refusal). The retry hint is how long the queue
needs to drain by half at the recent item rate, which the loop reports as calls come back.
"""

from __future__ import annotations

from prefixscore.engine.loop.batcher import Batcher
from prefixscore.engine.loop.loop_metrics import LoopMetrics
from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.runtime.prefix_cache import PoolExhausted

# the retry hint of a query larger than the whole pool: it fits no sooner later
NEVER_FITS_RETRY_MS = 60_000


class QueueFull(Exception):
    """Admission control refused work (the queue, or the prefix pool, is full); retry after `retry_after_ms`."""

    def __init__(self, reason: str, retry_after_ms: int) -> None:
        super().__init__(f"{reason}; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class Admission:
    """The queue's limits over `batcher` (items; item tokens, None: unlimited) and the refusals.
    `admit` and `pool_full` run under the device worker's lock; `observe_rate` on the device
    thread, as calls come back."""

    def __init__(self, batcher: Batcher, max_items: int, max_tokens: int | None, metrics: LoopMetrics) -> None:
        self.batcher = batcher
        self.max_items = max_items
        self.max_tokens = max_tokens
        self.metrics = metrics
        self._items_per_s = 0.0  # moving average, for the retry hint

    def admit(self, unit: WorkUnit) -> None:
        """Raises QueueFull when queueing `unit`'s items would pass a limit."""
        depth = self.batcher.depth
        if depth + len(unit.payload.items) > self.max_items:
            raise self._refusal(f"the queue holds {depth} items (limit {self.max_items})")
        # items alone undercount: a few long items cost as much device time as many short ones
        if self.max_tokens is not None:
            queued, tokens = self.batcher.queued_tokens, unit.tokens
            if queued + tokens > self.max_tokens:
                raise self._refusal(f"the queue holds {queued} tokens (limit {self.max_tokens})")

    def pool_full(self, full: PoolExhausted, total_pages: int) -> QueueFull:
        """The refusal of a query the prefix pool (`total_pages` in all) cannot hold now."""
        self.metrics.refused()
        retry = self.retry_after_ms() if full.needed <= total_pages else NEVER_FITS_RETRY_MS
        return QueueFull(str(full), retry)

    def observe_rate(self, items: int, seconds: float) -> None:
        """A call scored `items` in `seconds` (launch to read-back)."""
        if seconds > 0:
            rate = items / seconds
            self._items_per_s = rate if self._items_per_s == 0 else 0.8 * self._items_per_s + 0.2 * rate

    def retry_after_ms(self) -> int:
        """How long the queue needs to drain by half, from the recent item rate (50 ms .. 10 s)."""
        if self._items_per_s <= 0:
            return 1000
        return int(min(10_000, max(50, 500 * self.batcher.depth / self._items_per_s)))

    def _refusal(self, reason: str) -> QueueFull:
        self.metrics.refused()
        return QueueFull(reason, self.retry_after_ms())
