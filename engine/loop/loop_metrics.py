"""The device loop's gauges and counters, published from one place.

The metrics themselves are defined in telemetry/metrics.py; this is what the device loop
and its rooms (admission, page pins, recovery) tell them: refusals and prefix-cache
lookups, the cache's and the pool's gauges, each device call at launch and at read-back,
failed calls, and a log line for the compilations since the last sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.runtime.planner import CallPlan
from prefixscore.engine.runtime.prefix_cache import PrefixCache
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.telemetry.compiles import CompileCounter
from prefixscore.telemetry.logs import event
from prefixscore.telemetry.metrics import ServiceMetrics

log = logging.getLogger("prefixscore.worker")


class LoopMetrics:
    """Publishes the device loop's metrics into `metrics`; `queue_capacity`: the admission
    limit in items, published once."""

    def __init__(self, metrics: ServiceMetrics, queue_capacity: int) -> None:
        self.metrics = metrics
        metrics.queue_capacity.set(queue_capacity)
        self._compiles_seen = CompileCounter.count()
        self._last_done = 0.0  # when the last call was read back: the next one's device time starts there

    # ---- admission and the prefix cache ----------------------------------------------------------
    def refused(self) -> None:
        self.metrics.rejected.inc()

    def lookup(self, hit: bool) -> None:
        """One prefix-cache lookup: a hit when no new prefill runs for it."""
        (self.metrics.cache_hits if hit else self.metrics.cache_misses).inc()

    def cache(self, cache: PrefixCache) -> None:
        """The prefix cache's gauges, after its pins or entries changed."""
        self.metrics.cache_bytes.set(cache.bytes)
        self.metrics.cache_entries.set(len(cache))
        self.metrics.cache_pinned.set(cache.pinned)

    def requested(self, tokens: int) -> None:
        """Tokens a request admitted needs computed, each once (against the tokens computed)."""
        self.metrics.requested_tokens.inc(tokens)

    def queue_depth(self, items: int) -> None:
        self.metrics.queue_depth.set(items)

    def engine_ready(
        self, engine: ScoringEngine, cache: PrefixCache, queued: Callable[[], int], running: Callable[[], int]
    ) -> None:
        """The engine is built: its pool's size and evictions, and the endpoint picker's gauges
        (telemetry/metrics.py), read when scraped: nothing is counted per request for them.
        `queued` and `running`: requests waiting for the device, and on it."""
        cache.on_evict = lambda size: self.metrics.cache_evictions.inc()
        self.metrics.pool_bytes.set(engine.pool_bytes)
        labels = {"block_size": str(cache.page_tokens), "num_gpu_blocks": str(cache.total_pages)}
        self.metrics.pool_info.labels(**labels).set(1)
        self.metrics.pool_usage.set_function(lambda: cache.usage)
        self.metrics.queued_requests.set_function(queued)
        self.metrics.running_requests.set_function(running)

    # ---- device calls ----------------------------------------------------------------------------
    def launched(self, plan: CallPlan) -> None:
        """A call went to the device: what it carries, and its padding."""
        real, device = plan.prefill_tokens + plan.item_tokens, max(plan.device_tokens, 1)
        self.metrics.batch_size.observe(plan.items)
        self.metrics.batch_padding.observe(1.0 - real / device)
        self.metrics.padding_tokens.inc(max(0, device - real))
        self.metrics.computed_tokens.inc(plan.computed_tokens)
        self.metrics.tokens.labels("item").inc(plan.item_tokens)
        self.metrics.tokens.labels("prefix").inc(plan.prefill_tokens)

    def read_back(self, plan: CallPlan, launched_at: float, now: float) -> None:
        """A call came back whole at `now`."""
        # device time of this call: it ran after the previous one finished (one device, in order)
        self.metrics.batch_seconds.labels("items").observe(now - max(launched_at, self._last_done))
        self._last_done = now
        self.metrics.items_scored.inc(plan.items)

    def first_scores(self, unit: WorkUnit, now: float) -> None:
        """A request's first scores came back at `now`."""
        self.metrics.first_batch_seconds.labels(unit.ticket.method).observe(now - unit.ticket.created)

    def nonfinite(self) -> None:
        self.metrics.nonfinite.inc()

    def failed_call(self) -> None:
        self.metrics.failed_calls.inc()

    def failed_alone(self) -> None:
        self.metrics.failed_alone.inc()

    # ---- compilations ----------------------------------------------------------------------------
    def compiles(self) -> None:
        """Log the compilations since the last sync, if any (the metric reads them when scraped)."""
        count, seconds = CompileCounter.count(), CompileCounter.seconds()
        if count > self._compiles_seen:
            event(log, "compiled", level=logging.DEBUG, total=count, seconds=round(seconds, 3))
        self._compiles_seen = count
