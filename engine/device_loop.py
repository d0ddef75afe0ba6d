"""The device worker: the one thread that touches the device.

It loads the model (through the `startup` callable it is given), then loops: plan the
next device call from all pending work (engine/batcher.py: prefill chunks of new
queries and items of any number of queries in one call), launch it, and only then read
back the previous call, so host-side planning and result delivery overlap device work
(JAX dispatch is asynchronous).

Other threads call `submit`, `cancel`, `open_prefix` and `release`: they take the
worker's lock, and the prefix cache's pages are acquired there, at once, so a request
the pool cannot hold is refused before it queues (RESOURCE_EXHAUSTED), never an
out-of-memory on the device. Results come back through each unit's `on_done`
callback: the units one call finished are handed over together (`deliver`: the
server runs their callbacks on its event loop, one wake-up per call).

A device call that fails fails none of its requests at once: its work is retried in
calls of its own, halving, and only work that fails alone fails its request
(engine/isolation.py). A device whose calls keep failing, with none succeeding between
them, breaks the loop (the server goes NOT_SERVING and exits).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from prefixscore.engine import isolation
from prefixscore.engine.batcher import Batcher, Call, NonFiniteScores, WorkUnit, take_results
from prefixscore.engine.prefix_cache import CachedPrefix, PoolExhausted, PrefixCache
from prefixscore.engine.scoring_engine import ScoringEngine
from prefixscore.telemetry.compiles import CompileCounter
from prefixscore.telemetry.logs import event
from prefixscore.telemetry.metrics import ServiceMetrics

log = logging.getLogger("prefixscore.worker")
# failed device calls in a row, none succeeding between them, after which the device is taken
# for broken: isolating one request's fault takes about log2(queries) + log2(items) failures,
# each between successful calls of the work it cleared
MAX_FAILED_CALLS_IN_A_ROW = 24


def run_on_done(units: list[WorkUnit]) -> None:
    for unit in units:
        try:
            unit.on_done(unit)
        except Exception:
            log.exception("on_done callback failed")


class QueueFull(Exception):
    """Admission control refused work (the queue, or the prefix pool, is full); retry after `retry_after_ms`."""

    def __init__(self, reason: str, retry_after_ms: int) -> None:
        super().__init__(f"{reason}; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class DeadlineExpired(Exception):
    """The unit's deadline passed before its items reached the device."""


class WorkerStopped(Exception):
    """The worker is stopped (or failed to start) and takes no work."""


class WorkerFailed(WorkerStopped):
    """The device loop itself broke: the process must be restarted (health NOT_SERVING, exit non-zero)."""


class DeviceFailing(RuntimeError):
    """Device calls keep failing, whatever they carry: the device loop stops."""


@dataclasses.dataclass
class _Launched:
    call: Call
    probs: Any  # [devices * rows, labels] on the device
    launched_at: float
    epochs: dict[int, int]  # id(entry) -> its epoch at launch, for the queries the call's items read


@dataclasses.dataclass
class StreamPin:
    """An open stream's hold on its query's pages; `ready` resolves (cached tokens) once the
    query's prefill is launched."""

    entry: CachedPrefix
    ready: concurrent.futures.Future


class DeviceWorker:
    """Owns the engine and the prefix cache; see the module doc.

    startup: builds the engine on this thread (load weights, compile); its
    return value becomes `self.engine`. `on_ready(error)` is called once after
    it, with None or the exception that stopped the start. `deliver(units)` takes
    the units finished by one step of the loop (one device call's, typically).
    """

    def __init__(
        self,
        startup: Callable[[], ScoringEngine],
        metrics: ServiceMetrics,
        max_queue_items: int,
        on_ready: Callable[[BaseException | None], None] = lambda error: None,
        batch_wait_s: float = 0.0,
        max_queue_tokens: int | None = None,
        on_failure: Callable[[BaseException], None] = lambda error: None,
        deliver: Callable[[list[WorkUnit]], None] | None = None,
    ) -> None:
        self._startup = startup
        # finished units leave in one hand-off per call (the server's: one wake-up of its event
        # loop, which runs their on_done); by default on_done runs here, on the device thread
        self._deliver = deliver or run_on_done
        self._done: list[WorkUnit] = []  # finished under the lock, delivered after it
        self.metrics = metrics
        self.max_queue_items = max_queue_items
        self.max_queue_tokens = max_queue_tokens
        metrics.queue_capacity.set(max_queue_items)
        self._on_failure = on_failure
        self.failure: BaseException | None = None  # set when the device loop broke
        self.batch_wait_s = batch_wait_s
        self._on_ready = on_ready
        self.engine: ScoringEngine | None = None
        self.batcher: Batcher | None = None
        self.cache: PrefixCache | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._running = False
        self._paused = 0
        self._wakeups = 0  # counts _wake(): a change made while the loop was not waiting is not lost
        self._live = 0  # units submitted and not yet finished (queued or on the device)
        self._items_per_s = 0.0  # moving average, for the retry hint
        self._compiles_seen = CompileCounter.count()
        self._compile_s_seen = CompileCounter.seconds()
        self._last_done = 0.0
        self._failed_in_a_row = 0
        self._on_device: list[Call] = []  # launched, not yet read back (at most two: the loop overlaps one)
        self._groups = itertools.count()  # isolation groups, oldest first
        self._thread = threading.Thread(target=self._main, name="prefixscore-device", daemon=True)

    # ---- other threads ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, unit: WorkUnit) -> None:
        """Queue `unit`'s items, pinning its query's pages; raises QueueFull (admission control:
        the queue or the prefix pool is full) or WorkerStopped."""
        with self._cv:
            self._check_running()
            assert self.batcher is not None
            depth = self.batcher.depth
            if depth + len(unit.items) > self.max_queue_items:
                self.metrics.rejected.inc()
                reason = f"the queue holds {depth} items (limit {self.max_queue_items})"
                raise QueueFull(reason, self._retry_after_ms())
            # items alone undercount: a few long items cost as much device time as many short ones
            if self.max_queue_tokens is not None:
                queued, tokens = self.batcher.queued_tokens, unit.tokens
                if queued + tokens > self.max_queue_tokens:
                    self.metrics.rejected.inc()
                    reason = f"the queue holds {queued} tokens (limit {self.max_queue_tokens})"
                    raise QueueFull(reason, self._retry_after_ms())
            if not unit.item_first and unit.entry is None:
                unit.entry, hit = self._acquire(unit.prefix)
                unit.cached_tokens = len(unit.prefix) if hit else 0
                self._count_lookup(unit, hit)
            self.batcher.add(unit)
            self._live += 1
            self.metrics.queue_depth.set(self.batcher.depth)
            self._wake()

    def cancel(self, unit: WorkUnit) -> None:
        """Drop `unit`'s queued items (client cancelled or deadline passed); items already
        on the device finish but are not delivered. on_done is not called after this."""
        with self._cv:
            if unit.finished or self.batcher is None:
                return
            unit.finished = True
            self._live -= 1
            self.batcher.cancel(unit)
            self._cancel_pieces(unit)
            self._release(unit)
            self.metrics.queue_depth.set(self.batcher.depth)

    def open_prefix(self, prefix: tuple[int, ...]) -> StreamPin:
        """Pin `prefix`'s pages for an open stream (prefilling it if new). Raises QueueFull at
        once when the pool cannot hold it; `ready` resolves with the cached tokens."""
        with self._cv:
            self._check_running()
            entry, hit = self._acquire(prefix)
            self.metrics.cache_hits.inc() if hit else self.metrics.cache_misses.inc()
            ready: concurrent.futures.Future = concurrent.futures.Future()
            cached = len(prefix) if hit else 0
            if entry.ready:
                ready.set_result(cached)
                return StreamPin(entry, ready)

            def done(unit: WorkUnit) -> None:
                if unit.error is not None:
                    ready.set_exception(unit.error)
                else:
                    ready.set_result(cached)

            # a unit without items: its query's chunks, then done. It holds a pin of its own, so
            # the pages stay its until the prefill is launched even if the stream closes first
            unit = WorkUnit(prefix, [], (), False, False, on_done=done, counts_lookup=False)
            unit.entry = entry
            assert self.cache is not None
            self.cache.pin(entry)
            assert self.batcher is not None
            self.batcher.add(unit)
            self._live += 1
            self._wake()
            return StreamPin(entry, ready)

    def release(self, pin: StreamPin) -> None:
        """Unpin a stream's prefix (it stays cached until its pages are needed)."""
        with self._cv:
            if self.cache is not None:
                self.cache.release(pin.entry)
                self._cache_gauges()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold device calls while inside (but the prefills of opening streams, which must
        answer their open): lets tests and operators observe queued work deterministically."""
        with self._cv:
            self._paused += 1
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self._wake()

    def stop(self, timeout: float | None = None) -> None:
        """Finish queued work, then end the thread."""
        with self._cv:
            self._stopping = True
            self._paused = 0
            self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def depth(self) -> int:
        with self._cv:
            return self.batcher.depth if self.batcher else 0

    def _check_running(self) -> None:
        """Lock held."""
        if not self._running or self._stopping:
            raise WorkerStopped("the device worker is not running")

    def _acquire(self, prefix: tuple[int, ...]) -> tuple[CachedPrefix, bool]:
        """Lock held: the prefix's pages, pinned; QueueFull when the pool cannot hold it."""
        assert self.cache is not None
        try:
            entry, hit = self.cache.acquire(prefix)
        except PoolExhausted as full:
            self.metrics.rejected.inc()
            retry = self._retry_after_ms() if full.needed <= self.cache.total_pages else 60_000
            raise QueueFull(str(full), retry) from full
        self._cache_gauges()
        return entry, hit

    def _release(self, unit: WorkUnit) -> None:
        """Lock held: give back the unit's pin on its query's pages, once."""
        if unit.entry is not None and not unit.released and self.cache is not None:
            unit.released = True
            self.cache.release(unit.entry)
            self._cache_gauges()

    # ---- the device thread -----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._startup()
            b = engine.buckets
            self.cache = engine.prefix_cache
            self.cache.on_evict = lambda size: self.metrics.cache_evictions.inc()
            self.metrics.pool_bytes.set(engine.pool_bytes)
            self.batcher = Batcher(engine.builder, b.prefill_chunk)
            self.engine = engine
            self._pool_gauges()
        except BaseException as err:  # reported to the server, which exits
            with self._cv:
                self._stopping = True
            self._on_ready(err)
            return
        self._sync_compile_metrics()
        with self._cv:
            self._running = True
        self._on_ready(None)
        stopped: WorkerStopped = WorkerStopped("the server is shutting down")
        try:
            self._loop()
        except BaseException as err:
            # the loop itself broke (not one device call: those fail only their units): this
            # process cannot serve any more; the server goes NOT_SERVING and exits non-zero
            log.exception("the device loop failed")
            self.failure = err
            stopped = WorkerFailed("the device worker failed; the server is restarting, retry on another replica")
        finally:
            with self._cv:
                self._running = False
            self._fail_all(stopped)
        if self.failure is not None:
            self._on_failure(self.failure)

    def _loop(self) -> None:
        assert self.batcher is not None
        inflight: _Launched | None = None
        while True:
            with self._cv:
                while not self._has_work(inflight):
                    self._cv.wait(timeout=self._wait_timeout())
                    self._expire(time.monotonic())
                exiting = self._stopping and inflight is None and not self.batcher.ready()
            self._flush()  # what expired while waiting
            if exiting:
                return
            if self.batch_wait_s and inflight is None:
                time.sleep(self.batch_wait_s)  # let concurrent requests join the first call
            with self.engine.calls_lock:  # type: ignore[union-attr]
                with self._cv:
                    self._expire(time.monotonic())
                    for unit in self.batcher.prefilled():
                        self._finish(unit, None)
                    call = self.batcher.next_call(opens_only=bool(self._paused))
                    self.metrics.queue_depth.set(self.batcher.depth)
                    planned_at = self._wakeups
                launched = self._launch(call) if call else None
            self._flush()  # what planning finished (prefills, expiries, failed launches)
            if inflight is not None:
                self._complete(inflight)
                self._flush()
            elif call is None:  # (a call that failed to launch left its work retried, not waiting)
                self._wait_for_shapes(planned_at)
            inflight = launched
            self._sync_compile_metrics()

    def _wait_for_shapes(self, planned_at: int) -> None:
        """No call could be planned: what is queued needs a call shape that a staged warm-up has
        not compiled yet. Wait for the next stage (shapes_changed), new work or a deadline,
        unless one came since planning (`planned_at`: the wake-ups seen then); stopping, fail
        it (the shapes will not come)."""
        assert self.batcher is not None
        with self._cv:
            if self._stopping:
                for unit in self.batcher.live_units():
                    self.batcher.cancel(unit)
                    self._finish(unit, WorkerStopped("the server stopped before the items could be scored"))
            elif self._wakeups == planned_at and self.batcher.ready(opens_only=bool(self._paused)):
                self._cv.wait(timeout=self._wait_timeout())
        self._flush()

    def shapes_changed(self) -> None:
        """More call shapes are compiled (a staged warm-up): work that fit none may fit now."""
        with self._cv:
            self._wake()

    def _wake(self) -> None:
        """Something changed (work, shapes, pause, stop): wake the device loop (lock held)."""
        self._wakeups += 1
        self._cv.notify()

    def _has_work(self, inflight: _Launched | None) -> bool:
        """Lock held."""
        assert self.batcher is not None
        return bool(inflight is not None or self._stopping or self.batcher.ready(opens_only=bool(self._paused)))

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

    def _launch(self, call: Call) -> _Launched | None:
        """Start one device call (asynchronously)."""
        engine = self.engine
        assert engine is not None
        plan = call.plan
        try:
            probs = engine.launch(plan)
        except Exception as err:
            log.exception("device call failed to launch")
            self._call_failed(call, err)
            return None
        real, device = plan.prefill_tokens + plan.item_tokens, max(plan.device_tokens, 1)
        self.metrics.batch_size.observe(plan.items)
        self.metrics.batch_padding.observe(1.0 - real / device)
        self.metrics.padding_tokens.inc(max(0, device - real))
        self.metrics.tokens.labels("item").inc(plan.item_tokens)
        self.metrics.tokens.labels("prefix").inc(plan.prefill_tokens)
        epochs = {id(u.entry): u.entry.epoch for u in (span.ref for span in plan.spans) if u.entry is not None}
        self._on_device.append(call)
        return _Launched(call, probs, time.monotonic(), epochs)

    def _complete(self, launched: _Launched) -> None:
        """Read one call back and deliver its rows: one slice per request, one pass for the call."""
        call = launched.call
        self._on_device.remove(call)
        try:
            out = np.asarray(launched.probs)
        except Exception as err:
            log.exception("device call failed")
            self._call_failed(call, err)
            return
        self._failed_in_a_row = 0
        now = time.monotonic()
        # device time of this call: it ran after the previous one finished (one device, in order)
        self.metrics.batch_seconds.labels("items").observe(now - max(launched.launched_at, self._last_done))
        self._last_done = now
        self.metrics.items_scored.inc(call.plan.items)
        self._observe_rate(call.plan.items, now - launched.launched_at)
        with self._cv:
            call = self._trusted(launched)
            complete, broken = take_results(call, out)
            for unit in broken:
                # a NaN is a wrong answer, not a score: fail the request, count it, keep serving
                self.metrics.nonfinite.inc()
                log.error("a device call returned non-finite scores (%s items)", len(unit.items))
                self.batcher.cancel(unit)  # type: ignore[union-attr]
                self._finish(unit, NonFiniteScores("the model produced non-finite scores (NaN or Inf)"))
            for span in call.plan.spans:
                unit = isolation.root(span.ref)
                if unit.first_scores_at is None and not unit.finished:
                    unit.first_scores_at = now
                    self.metrics.first_batch_seconds.labels(unit.method).observe(now - unit.created)
            for unit in complete:
                self._finish(unit, None)

    def _finish(self, unit: WorkUnit, error: BaseException | None) -> None:
        """Finish a unit once and give back its pin (lock held); delivered by _flush. A retried
        piece's error is its request's; its scores went to the request as they came."""
        if unit.parent is not None:
            unit.finished = True
            if error is not None:
                self._finish(unit.parent, error)
            return
        if unit.finished:
            return
        unit.finished = True
        self._live -= 1
        unit.error = error
        self._cancel_pieces(unit)
        self._release(unit)
        self._done.append(unit)

    def _cancel_pieces(self, unit: WorkUnit) -> None:
        """Lock held: the unit's retried pieces leave the queue with it."""
        for piece in unit.pieces:
            piece.finished = True
            if self.batcher is not None:
                self.batcher.cancel(piece)

    def _flush(self) -> None:
        """Hand the finished units over, outside the lock (their callbacks may take time)."""
        with self._cv:
            done, self._done = self._done, []
        if done:
            try:
                self._deliver(done)
            except Exception:
                log.exception("delivering results failed")

    def _call_failed(self, call: Call, err: BaseException) -> None:
        """A call failed: its work is retried in calls of its own, and the requests whose work
        failed alone fail (engine/isolation.py). Raises DeviceFailing when calls keep failing."""
        engine, batcher, cache = self.engine, self.batcher, self.cache
        assert engine is not None and batcher is not None and cache is not None
        self.metrics.failed_calls.inc()
        self._failed_in_a_row += 1
        if self._failed_in_a_row > MAX_FAILED_CALLS_IN_A_ROW:
            self._on_device.append(call)  # its requests fail with everything else (_fail_all)
            raise DeviceFailing(f"{self._failed_in_a_row} device calls failed in a row") from err
        with self._cv:
            if engine.pool_lost():  # every query's pages went with it
                engine.reset_pool()
                cache.rewrite_all()
            for entry in call.written:  # what it wrote may be garbage: prefilled again
                cache.rewrite(entry)
            rewritten = {id(entry) for entry in call.written}
            queued = [u for u in batcher.live_units() if u.entry is not None and id(u.entry) in rewritten]
            verdict = isolation.judge(call, isolation.pieces_of(call), queued)
            for culprit in verdict.culprits:
                self.metrics.failed_alone.inc()
                log.error("request %s failed in a device call of its own: %s", culprit.request_id or "-", err)
                batcher.cancel(culprit)
                self._finish(culprit, err)
            for retry in verdict.retries:
                self._retry(retry)
            ids = sorted({p.root.request_id or "-" for r in verdict.retries for p in r.pieces})
            if ids:
                log.warning("device call failed; retrying in %d calls of their own: %s", len(verdict.retries), ids)
            self._cache_gauges()
            self.metrics.queue_depth.set(batcher.depth)

    def _retry(self, retry: isolation.Retry) -> None:
        """Lock held: queue `retry`'s work as one isolation group (engine/batcher.py)."""
        assert self.batcher is not None
        group = next(self._groups)
        for unit in retry.queued:
            unit.group = group
        for piece in retry.pieces:
            request = piece.root
            unit = WorkUnit(
                request.prefix,
                request.items.rows(piece.first, piece.count),
                request.label_ids,
                request.apply_softmax,
                request.item_first,
                request.activation,
                method=request.method,
                request_id=request.request_id,
                counts_lookup=False,
                deadline=request.deadline,
                created=request.created,
            )
            unit.entry, unit.released = request.entry, True  # the request holds the pin
            unit.parent, unit.parent_first, unit.group = request, piece.first, group
            request.pieces.append(unit)
            self.batcher.add(unit)
        self._wake()

    def _trusted(self, launched: _Launched) -> Call:
        """Lock held: the call without the spans that read a query rewritten since it was
        launched (a failed call before it wrote it): those are retried, not delivered."""
        call = launched.call
        epochs = launched.epochs
        stale = [s for s in call.plan.spans if s.ref.entry is not None and epochs[id(s.ref.entry)] != s.ref.entry.epoch]
        if not stale:
            return call
        stale_call = dataclasses.replace(call, plan=dataclasses.replace(call.plan, spans=tuple(stale)))
        for retry in isolation.by_query(isolation.pieces_of(stale_call)):
            self._retry(retry)
        kept = tuple(s for s in call.plan.spans if s not in stale)
        return dataclasses.replace(call, plan=dataclasses.replace(call.plan, spans=kept))

    def _fail_all(self, err: BaseException) -> None:
        """The loop ended: fail what is queued and what is on the device (never read back)."""
        with self._cv:
            units = list(self.batcher.live_units()) if self.batcher else []
            units += [isolation.root(span.ref) for call in self._on_device for span in call.plan.spans]
            self._on_device.clear()
            for unit in units:
                self.batcher.cancel(unit)  # type: ignore[union-attr]
                self._finish(unit, err)
        self._flush()

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
        """One hit or miss per request (or stream open): hit when no new prefill runs for it."""
        if unit.counts_lookup:
            (self.metrics.cache_hits if hit else self.metrics.cache_misses).inc()

    def _cache_gauges(self) -> None:
        assert self.cache is not None
        self.metrics.cache_bytes.set(self.cache.bytes)
        self.metrics.cache_entries.set(len(self.cache))
        self.metrics.cache_pinned.set(self.cache.pinned)

    def _pool_gauges(self) -> None:
        """The endpoint picker's gauges (telemetry/metrics.py), read when scraped: nothing is
        counted per request for them."""
        cache, batcher = self.cache, self.batcher
        assert cache is not None and batcher is not None
        labels = {"block_size": str(cache.page_tokens), "num_gpu_blocks": str(cache.total_pages)}
        self.metrics.pool_info.labels(**labels).set(1)
        self.metrics.pool_usage.set_function(lambda: cache.usage)

        def queued() -> int:
            with self._cv:
                return len(batcher.units)

        def running() -> int:
            with self._cv:
                return max(0, self._live - len(batcher.units))

        self.metrics.queued_requests.set_function(queued)
        self.metrics.running_requests.set_function(running)

    def _sync_compile_metrics(self) -> None:
        count, seconds = CompileCounter.count(), CompileCounter.seconds()
        if count > self._compiles_seen:
            self.metrics.compilations.inc(count - self._compiles_seen)
            self.metrics.compile_seconds.inc(max(0.0, seconds - self._compile_s_seen))
            event(log, "compiled", level=logging.DEBUG, total=count, seconds=round(seconds, 3))
        self._compiles_seen, self._compile_s_seen = count, seconds
