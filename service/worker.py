"""The device worker: the one thread that touches the device.

It loads the model (through the `startup` callable it is given), then loops:
run queued calls (stream opens: prefill and pin a prefix), resolve the prefix KV
of new groups (prefix cache hit, or prefill on a miss), take the next device
batch from the `Batcher` and launch it, and only then read back the previous
batch, so host-side padding and result delivery overlap device work (JAX
dispatch is asynchronous). Items of all requests that share a query, labels and
options merge into the same device batches.

Other threads only call `submit`, `cancel`, `call` and `release`; results come
back through each unit's `on_done` callback, on this thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from prefixscore.model.engine import CompileCounter, PrefixKV, ScoringEngine
from prefixscore.service.batcher import Batch, Batcher, Group, WorkUnit
from prefixscore.service.logs import event
from prefixscore.service.metrics import ServiceMetrics
from prefixscore.service.prefix_cache import PrefixCache

log = logging.getLogger("prefixscore.worker")


class QueueFull(Exception):
    """Admission control refused work; retry after `retry_after_ms`."""

    def __init__(self, queued: int, limit: int, retry_after_ms: int) -> None:
        super().__init__(f"the queue holds {queued} items (limit {limit}); retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class DeadlineExpired(Exception):
    """The unit's deadline passed before its items reached the device."""


class WorkerStopped(Exception):
    """The worker is stopped (or failed to start) and takes no work."""


@dataclasses.dataclass
class _Launched:
    batch: Batch
    probs: Any  # [batch, label_bucket] on the device (or numpy for item_first)
    launched_at: float


class DeviceWorker:
    """Owns the engine and the prefix cache; see the module doc.

    startup: builds the engine on this thread (load weights, compile); its
    return value becomes `self.engine`. `on_ready(error)` is called once after
    it, with None or the exception that stopped the start.
    """

    def __init__(
        self,
        startup: Callable[[], ScoringEngine],
        metrics: ServiceMetrics,
        max_queue_items: int,
        prefix_cache_bytes: int,
        on_ready: Callable[[BaseException | None], None] = lambda error: None,
        batch_wait_s: float = 0.0,
    ) -> None:
        self._startup = startup
        self.metrics = metrics
        self.max_queue_items = max_queue_items
        metrics.queue_capacity.set(max_queue_items)
        self.batch_wait_s = batch_wait_s
        self._on_ready = on_ready
        self.engine: ScoringEngine | None = None
        self.batcher: Batcher | None = None
        self.cache: PrefixCache[PrefixKV] = PrefixCache(
            prefix_cache_bytes, lambda kv: kv.nbytes, on_evict=lambda size: metrics.cache_evictions.inc()
        )
        self._open: dict[tuple[int, ...], list] = {}  # prefix -> [kv, open streams] (device thread only)
        self._cv = threading.Condition()
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._stopping = False
        self._running = False
        self._exited = False  # the thread ended: calls are refused
        self._paused = 0
        self._items_per_s = 0.0  # moving average, for the retry hint
        self._compiles_seen = CompileCounter.count()
        self._compile_s_seen = CompileCounter.seconds()
        self._last_done = 0.0
        self._thread = threading.Thread(target=self._main, name="prefixscore-device", daemon=True)

    # ---- other threads ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, unit: WorkUnit) -> None:
        """Queue `unit`'s items; raises QueueFull (admission control) or WorkerStopped."""
        with self._cv:
            if not self._running or self._stopping:
                raise WorkerStopped("the device worker is not running")
            assert self.batcher is not None
            if self.batcher.depth + len(unit.items) > self.max_queue_items:
                self.metrics.rejected.inc()
                raise QueueFull(self.batcher.depth, self.max_queue_items, self._retry_after_ms())
            group = self.batcher.add(unit)
            if group.state is not None and not unit.item_first:
                self._count_lookup(unit, hit=True)  # joins items whose prefix KV is on the device already
            self.metrics.queue_depth.set(self.batcher.depth)
            self._cv.notify()

    def cancel(self, unit: WorkUnit) -> None:
        """Drop `unit`'s queued items (client cancelled or deadline passed); items already
        on the device finish but are not delivered. on_done is not called after this."""
        with self._cv:
            if unit.finished or self.batcher is None:
                return
            unit.finished = True
            self.batcher.cancel(unit)
            self.metrics.queue_depth.set(self.batcher.depth)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the device thread before the next batch; its result in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._exited:
                future.set_exception(WorkerStopped("the device worker is not running"))
                return future
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def open_prefix(self, prefix: tuple[int, ...]) -> concurrent.futures.Future:
        """Prefill (or find in the cache) and pin `prefix`; the future gives the cached tokens."""

        def run() -> int:
            self.cache.pin(prefix)  # pinned before the put, so the new entry is never the one evicted
            try:
                kv, hit = self._resolve(prefix)
            except BaseException:
                self.cache.unpin(prefix)
                raise
            (self.metrics.cache_hits if hit else self.metrics.cache_misses).inc()
            self._open.setdefault(prefix, [kv, 0])[1] += 1
            return len(prefix) if hit else 0

        return self.call(run)

    def release(self, prefix: tuple[int, ...]) -> None:
        """Unpin a prefix opened with open_prefix (on the device thread: eviction frees device memory)."""

        def run() -> None:
            entry = self._open.get(prefix)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._open[prefix]
            self.cache.unpin(prefix)
            self._cache_gauges()

        self.call(run)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold item batches (calls and prefills still run) while inside: lets tests and
        operators observe queued work deterministically."""
        with self._cv:
            self._paused += 1
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self._cv.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish queued work, then end the thread."""
        with self._cv:
            self._stopping = True
            self._paused = 0
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def depth(self) -> int:
        return self.batcher.depth if self.batcher else 0

    # ---- the device thread -----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._startup()
            self.batcher = Batcher(self._planner, self._window(self.engine))
        except BaseException as err:  # reported to the server, which exits
            with self._cv:
                self._stopping = self._exited = True
                calls, self._calls = self._calls, []
            for _, future in calls:
                future.set_exception(WorkerStopped("the device worker failed to start"))
            self._on_ready(err)
            return
        self._sync_compile_metrics()
        with self._cv:
            self._running = True
        self._on_ready(None)
        try:
            self._loop()
        finally:
            with self._cv:
                self._running = False
                self._exited = True
            self._fail_all(WorkerStopped("the server is shutting down"))

    def _planner(self, lengths: list[int], sequence: bool) -> list:
        assert self.engine is not None
        return self.engine.plan(lengths, sequence=sequence)

    @staticmethod
    def _window(engine: ScoringEngine) -> int:
        """Items offered to the planner per device call: at least what one call can hold."""
        b = engine.buckets
        per_device = b.rows(b.max_batch_tokens) if hasattr(b, "rows") else b.batch[-1]
        return max(1, per_device * getattr(engine, "n_devices", 1))

    def _loop(self) -> None:
        assert self.batcher is not None
        inflight: _Launched | None = None
        while True:
            with self._cv:
                while not self._has_work(inflight):
                    self._cv.wait(timeout=self._wait_timeout())
                    self._expire(time.monotonic())
                if (
                    self._stopping
                    and inflight is None
                    and not self._calls
                    and not self.batcher.unresolved()
                    and not self._batch_ready()
                ):
                    return
                calls, self._calls = self._calls, []
                unresolved = [(g, list(g.waiting)) for g in self.batcher.unresolved()]
            for fn, future in calls:
                self._run_call(fn, future)
            for group, waiting in unresolved:
                self._resolve_group(group, waiting)
            if self.batch_wait_s and inflight is None:
                time.sleep(self.batch_wait_s)  # let concurrent requests join the first batch
            with self._cv:
                self._expire(time.monotonic())
                batch = None if self._paused else self.batcher.next_batch()
                for group in self.batcher.prune():
                    if not group.item_first:
                        self.cache.unpin(group.prefix)  # may evict it now, if over the byte budget
                        self._cache_gauges()
                self.metrics.queue_depth.set(self.batcher.depth)
            launched = self._launch(batch) if batch else None
            if inflight is not None:
                self._complete(inflight)
            inflight = launched
            self._sync_compile_metrics()

    def _has_work(self, inflight: _Launched | None) -> bool:
        """Lock held."""
        assert self.batcher is not None
        return bool(
            inflight is not None
            or self._calls
            or self._stopping
            or self.batcher.unresolved()
            or (not self._paused and self._batch_ready())
        )

    def _batch_ready(self) -> bool:
        assert self.batcher is not None
        return self.batcher.ready()

    def _wait_timeout(self) -> float | None:
        """Wake at the next queued deadline so expired work leaves the queue promptly."""
        assert self.batcher is not None
        deadlines = [u.deadline for u in self.batcher.live_units() if u.deadline is not None]
        return max(0.0, min(deadlines) - time.monotonic()) + 0.001 if deadlines else None

    def _expire(self, now: float) -> None:
        """Fail queued units whose deadline passed (lock held)."""
        assert self.batcher is not None
        expired = [u for u in self.batcher.live_units() if u.deadline is not None and u.deadline <= now]
        for unit in expired:
            self.batcher.cancel(unit)
            self._finish(unit, DeadlineExpired("the deadline passed before the items were scored"))

    def _run_call(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as err:
            future.set_exception(err)

    def _resolve(self, prefix: tuple[int, ...]) -> tuple[PrefixKV, bool]:
        """The prefix KV from the cache, or prefilled and cached; (kv, cache hit)."""
        assert self.engine is not None
        kv = self.cache.get(prefix)
        if kv is not None:
            return kv, True
        start = time.monotonic()
        kv = self.engine.prefill(prefix)
        # wait here: prefills are rare next to item batches, and this measures them honestly
        kv.keys.block_until_ready()
        self.metrics.batch_seconds.labels("prefill").observe(time.monotonic() - start)
        self.metrics.tokens.labels("prefix").inc(len(prefix))
        self.cache.put(prefix, kv)
        self._cache_gauges()
        return kv, False

    def _resolve_group(self, group: Group, waiting: list[WorkUnit]) -> None:
        """Give a new group its prefix KV (pinned while the group lives)."""
        assert self.batcher is not None
        if group.item_first:
            state: object = True  # whole sequences, no prefix
            hit = False
        else:
            if all(u.cancelled for u in waiting):
                with self._cv:
                    if all(u.cancelled for u in group.waiting):
                        self.batcher.groups.pop(group.key, None)
                        return
            self.cache.pin(group.prefix)
            try:
                if group.prefix in self._open:  # an open stream holds it: no lookup to count
                    state, hit = self._open[group.prefix][0], True
                else:
                    state, hit = self._resolve(group.prefix)
            except Exception as err:
                self.cache.unpin(group.prefix)
                log.exception("prefill failed")
                with self._cv:
                    self.batcher.groups.pop(group.key, None)
                    for unit in group.waiting:
                        self.batcher.cancel(unit)
                        self._finish(unit, err)
                return
        with self._cv:
            group.state = state
            for unit in group.waiting:
                unit.cached_tokens = len(group.prefix) if hit else 0
                if not group.item_first:
                    self._count_lookup(unit, hit)
            group.waiting.clear()

    def _launch(self, batch: Batch) -> _Launched | None:
        """Start one device batch (asynchronously for prefix batches)."""
        engine = self.engine
        assert engine is not None
        group = batch.group
        labels, softmax = group.key[1], group.key[2]
        items = batch.items
        stats = getattr(engine, "stats", None)  # the engine's own count of device tokens, when it keeps one
        device_before = stats["device_tokens"] if stats else 0
        try:
            if group.item_first:
                # whole sequences (no shared prefix): one synchronous engine call
                probs: Any = engine.score_sequences(items, labels, softmax)
            else:
                probs = engine.dispatch_items(group.state, items, batch.shape, labels, softmax)  # type: ignore[arg-type]
        except Exception as err:
            log.exception("device batch failed to launch")
            self._fail_batch(batch, err)
            return None
        real = batch.tokens
        device = stats["device_tokens"] - device_before if stats else batch.shape.batch * batch.shape.length
        device = max(device, real)
        self.metrics.batch_size.observe(len(items))
        self.metrics.batch_padding.observe(1.0 - real / device)
        self.metrics.padding_tokens.inc(device - real)
        self.metrics.tokens.labels("item").inc(real)
        return _Launched(batch, probs, time.monotonic())

    def _complete(self, launched: _Launched) -> None:
        """Read one batch back and deliver its rows."""
        batch = launched.batch
        n_labels = len(batch.group.key[1])
        try:
            out = np.asarray(launched.probs)[: len(batch.entries), :n_labels]
        except Exception as err:
            log.exception("device batch failed")
            self._fail_batch(batch, err)
            return
        now = time.monotonic()
        # device time of this batch: it ran after the previous one finished (one device, in order)
        self.metrics.batch_seconds.labels("items").observe(now - max(launched.launched_at, self._last_done))
        self._last_done = now
        self.metrics.items_scored.inc(len(batch.entries))
        self._observe_rate(len(batch.entries), now - launched.launched_at)
        with self._cv:
            for row, (unit, index) in enumerate(batch.entries):
                if unit.finished:
                    continue  # cancelled while on the device
                unit.scores[index] = out[row]
                unit.remaining -= 1
                if unit.first_scores_at is None:
                    unit.first_scores_at = now
                    self.metrics.first_batch_seconds.labels(unit.method).observe(now - unit.created)
                if unit.remaining == 0:
                    self._finish(unit, None)

    def _finish(self, unit: WorkUnit, error: BaseException | None) -> None:
        """Deliver a unit once (lock held)."""
        if unit.finished:
            return
        unit.finished = True
        unit.error = error
        try:
            unit.on_done(unit)
        except Exception:
            log.exception("on_done callback failed")

    def _fail_batch(self, batch: Batch, err: BaseException) -> None:
        assert self.batcher is not None
        with self._cv:
            for unit, _ in batch.entries:
                if not unit.finished:
                    self.batcher.cancel(unit)
                    self._finish(unit, err)

    def _fail_all(self, err: BaseException) -> None:
        with self._cv:
            calls, self._calls = self._calls, []
            units = list(self.batcher.live_units()) if self.batcher else []
            for unit in units:
                self.batcher.cancel(unit)  # type: ignore[union-attr]
                self._finish(unit, err)
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(err)

    # ---- metrics ---------------------------------------------------------------------------------
    def _observe_rate(self, items: int, seconds: float) -> None:
        if seconds > 0:
            rate = items / seconds
            self._items_per_s = rate if self._items_per_s == 0 else 0.8 * self._items_per_s + 0.2 * rate

    def _retry_after_ms(self) -> int:
        """How long the queue needs to drain by half, from the recent item rate (50 ms .. 10 s)."""
        assert self.batcher is not None
        if self._items_per_s <= 0:
            return 1000
        return int(min(10_000, max(50, 500 * self.batcher.depth / self._items_per_s)))

    def _count_lookup(self, unit: WorkUnit, hit: bool) -> None:
        """One hit or miss per request (or stream open): hit when no prefill ran for it."""
        if unit.counts_lookup and not unit.cancelled:
            (self.metrics.cache_hits if hit else self.metrics.cache_misses).inc()

    def _cache_gauges(self) -> None:
        self.metrics.cache_bytes.set(self.cache.bytes)
        self.metrics.cache_entries.set(len(self.cache))

    def _sync_compile_metrics(self) -> None:
        count, seconds = CompileCounter.count(), CompileCounter.seconds()
        if count > self._compiles_seen:
            self.metrics.compilations.inc(count - self._compiles_seen)
            self.metrics.compile_seconds.inc(max(0.0, seconds - self._compile_s_seen))
            event(log, "compiled", level=logging.DEBUG, total=count, seconds=round(seconds, 3))
        self._compiles_seen, self._compile_s_seen = count, seconds
