"""The device worker: the one thread that touches the device.

It loads the model (through the `startup` callable it is given), then loops: plan the
next device call from all pending work (engine/loop/batcher.py: prefill chunks of new
queries and items of any number of queries in one call), launch it, and only then read
back the previous call, so host-side planning and result delivery overlap device work
(JAX dispatch is asynchronous).

Other threads call `submit`, `cancel`, `open_prefix` and `release`: they take the
worker's lock, where admission control (engine/loop/admission.py: the queue's limits in items
and tokens) and the pins of queries' pages (engine/loop/page_pins.py) refuse at once what the
queue or the prefix pool cannot hold (RESOURCE_EXHAUSTED), never an out-of-memory on the
device. Results come back through each unit's `reply.on_done` callback: the units one call
finished are handed over together (`deliver`: the server runs their callbacks on its
event loop, one wake-up per call).

A device call that fails fails none of its requests at once: its work is retried in
calls of its own, halving, and only work that fails alone fails its request
(engine/loop/isolation.py decides; engine/loop/recovery.py carries it out). A device whose calls
keep failing, with none succeeding between them, breaks the loop (the server goes
NOT_SERVING and exits). The loop's gauges and counters are published in one place,
engine/loop/loop_metrics.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from prefixscore.engine.loop import isolation
from prefixscore.engine.loop.admission import Admission
from prefixscore.engine.loop.batcher import Batcher, Call, NonFiniteScores, PlanFailed, take_results
from prefixscore.engine.loop.loop_metrics import LoopMetrics
from prefixscore.engine.loop.page_pins import PagePins, StreamPin
from prefixscore.engine.loop.recovery import Recovery, epochs_at_launch
from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.runtime.prefix_cache import PrefixCache
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.telemetry.metrics import ServiceMetrics

log = logging.getLogger("prefixscore.worker")


def run_on_done(units: list[WorkUnit]) -> None:
    for unit in units:
        try:
            unit.reply.on_done(unit)
        except Exception:
            log.exception("on_done callback failed")


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
    pool_generation: int  # the pool it was launched onto (Recovery.pool_generation)


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
        self._published = LoopMetrics(metrics, max_queue_items)
        self.max_queue_items = max_queue_items
        self.max_queue_tokens = max_queue_tokens
        self._on_failure = on_failure
        self.failure: BaseException | None = None  # set when the device loop broke
        self.batch_wait_s = batch_wait_s
        self._on_ready = on_ready
        self.engine: ScoringEngine | None = None
        self.batcher: Batcher | None = None
        self.cache: PrefixCache | None = None
        # the loop's rooms, built with the engine (_main)
        self._admission: Admission | None = None
        self._pins: PagePins | None = None
        self._recovery: Recovery | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._running = False
        self._paused = 0
        self._wakeups = 0  # counts _wake(): a change made while the loop was not waiting is not lost
        self._live = 0  # units submitted and not yet finished (queued or on the device)
        self._on_device: list[Call] = []  # launched, not yet read back (at most two: the loop overlaps one)
        self._thread = threading.Thread(target=self._main, name="prefixscore-device", daemon=True)

    # ---- other threads ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, unit: WorkUnit) -> None:
        """Queue `unit`'s items, pinning its query's pages; raises QueueFull (admission control:
        the queue or the prefix pool is full) or WorkerStopped."""
        with self._cv:
            self._check_running()
            assert self.batcher is not None and self._admission is not None and self._pins is not None
            self._admission.admit(unit)
            self._pins.pin_request(unit)
            self.batcher.add(unit)
            self._live += 1
            self._published.queue_depth(self.batcher.depth)
            self._wake()

    def cancel(self, unit: WorkUnit) -> None:
        """Drop `unit`'s queued items (client cancelled or deadline passed); items already
        on the device finish but are not delivered. on_done is not called after this."""
        with self._cv:
            if unit.progress.finished or self.batcher is None:
                return
            unit.progress.finished = True
            self._live -= 1
            self.batcher.cancel(unit)
            self._cancel_pieces(unit)
            self._release(unit)
            self._published.queue_depth(self.batcher.depth)

    def open_prefix(self, prefix: tuple[int, ...], request_id: str = "") -> StreamPin:
        """Pin `prefix`'s pages for an open stream (prefilling it if new). Raises QueueFull at
        once when the pool cannot hold it; `ready` resolves with the cached tokens, or fails with
        the prefill's error when it failed in a call of its own (engine/loop/isolation.py)."""
        with self._cv:
            self._check_running()
            assert self.batcher is not None and self._pins is not None
            pin, prefill = self._pins.open_stream(prefix, request_id)
            if prefill is not None:  # its query's chunks, then done
                self.batcher.add(prefill)
                self._live += 1
                self._wake()
            return pin

    def release(self, pin: StreamPin) -> None:
        """Unpin a stream's prefix (it stays cached until its pages are needed)."""
        with self._cv:
            if self._pins is not None:
                self._pins.close_stream(pin)

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

    def abandon(self, error: WorkerStopped) -> None:
        """Fail every unit now, queued or on the device, and take no more work: another host of
        the group is gone, so the calls on the device will never complete (the device thread may
        be waiting in one of their collectives; it is not waited for)."""
        with self._cv:
            self._stopping = True
            self._wake()
        self._fail_all(error)

    @property
    def depth(self) -> int:
        with self._cv:
            return self.batcher.depth if self.batcher else 0

    def _check_running(self) -> None:
        """Lock held."""
        if not self._running or self._stopping:
            raise WorkerStopped("the device worker is not running")

    def _release(self, unit: WorkUnit) -> None:
        """Lock held: give back the unit's pin on its query's pages, once."""
        if self._pins is not None:
            self._pins.release_request(unit)

    def _queued_requests(self) -> int:
        """Units waiting for the device (a gauge, read when scraped)."""
        with self._cv:
            return len(self.batcher.units) if self.batcher else 0

    def _running_requests(self) -> int:
        """Units with items on the device and none queued (a gauge, read when scraped)."""
        with self._cv:
            return max(0, self._live - (len(self.batcher.units) if self.batcher else 0))

    # ---- the device thread -----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._startup()
            cache = engine.prefix_cache
            batcher = Batcher(engine.builder, engine.buckets.prefill_chunk)
            self._admission = Admission(batcher, self.max_queue_items, self.max_queue_tokens, self._published)
            self._pins = PagePins(cache, self._admission, self._published)
            self._recovery = Recovery(engine, batcher, cache, self._published, self._finish, self._wake)
            self.cache, self.batcher, self.engine = cache, batcher, engine
            self._published.engine_ready(engine, cache, self._queued_requests, self._running_requests)
        except BaseException as err:  # reported to the server, which exits
            with self._cv:
                self._stopping = True
            self._on_ready(err)
            return
        self._published.compiles()
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
                    planned_at = self._wakeups  # a failed plan's regrouped work wakes the loop again
                    try:
                        call = self.batcher.next_call(opens_only=bool(self._paused))
                    except PlanFailed as failure:
                        call = None
                        self._plan_failed(failure)
                    self._published.queue_depth(self.batcher.depth)
                launched = self._launch(call) if call else None
            self._flush()  # what planning finished (prefills, expiries, failed launches)
            if inflight is not None:
                self._complete(inflight)
                self._flush()
            elif call is None:  # (a call that failed to launch left its work retried, not waiting)
                self._wait_for_shapes(planned_at)
            inflight = launched
            self._published.compiles()

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
        deadlines = [u.ticket.deadline for u in self.batcher.live_units() if u.ticket.deadline is not None]
        return max(0.0, min(deadlines) - time.monotonic()) + 0.001 if deadlines else None

    def _expire(self, now: float) -> None:
        """Fail queued units whose deadline passed (lock held)."""
        assert self.batcher is not None
        expired = [u for u in self.batcher.live_units() if u.ticket.deadline is not None and u.ticket.deadline <= now]
        for unit in expired:
            self.batcher.cancel(unit)
            self._finish(unit, DeadlineExpired("the deadline passed before the items were scored"))

    def _launch(self, call: Call) -> _Launched | None:
        """Start one device call (asynchronously)."""
        engine = self.engine
        assert engine is not None
        plan = call.plan
        with self._cv:  # on the device from now: a launch that never returns (a host of the
            self._on_device.append(call)  # group lost in a collective) still fails its units
        generation = self._recovery.pool_generation  # type: ignore[union-attr]
        try:
            probs = engine.launch(plan)
        except Exception as err:
            log.exception("device call failed to launch")
            self._taken_off(call)
            # launched onto a pool that the call still on the device took down: that call is
            # judged when it is read back, and this one's work is retried as it was
            with self._cv:
                earlier = bool(self._on_device)
            self._call_failed(call, err, collateral=earlier and engine.pool_lost())
            return None
        self._published.launched(plan)
        return _Launched(call, probs, time.monotonic(), epochs_at_launch(plan), generation)

    def _taken_off(self, call: Call) -> None:
        """The call is off the device (read back, or failed): unless abandon() took it already."""
        with self._cv:  # by identity: a call's plan holds arrays
            self._on_device[:] = [c for c in self._on_device if c is not call]

    def _complete(self, launched: _Launched) -> None:
        """Read one call back and deliver its rows: one slice per request, one pass for the call."""
        batcher, admission, recovery = self.batcher, self._admission, self._recovery
        assert batcher is not None and admission is not None and recovery is not None
        call = launched.call
        self._taken_off(call)
        try:
            out = np.asarray(launched.probs)
        except Exception as err:
            log.exception("device call failed")
            # a pool made anew since its launch: an earlier call took down the pool it ran on
            self._call_failed(call, err, collateral=launched.pool_generation != recovery.pool_generation)
            return
        recovery.succeeded()
        now = time.monotonic()
        self._published.read_back(call.plan, launched.launched_at, now)
        admission.observe_rate(call.plan.items, now - launched.launched_at)
        with self._cv:
            call = recovery.trusted(call, launched.epochs)
            complete, broken = take_results(call, out)
            for unit in broken:
                # a NaN is a wrong answer, not a score: fail the request, count it, keep serving
                self._published.nonfinite()
                log.error("a device call returned non-finite scores (%s items)", len(unit.payload.items))
                batcher.cancel(unit)
                self._finish(unit, NonFiniteScores("the model produced non-finite scores (NaN or Inf)"))
            for span in call.plan.spans:
                unit = isolation.root(span.ref)
                if unit.reply.first_scores_at is None and not unit.progress.finished:
                    unit.reply.first_scores_at = now
                    self._published.first_scores(unit, now)
            for unit in complete:
                self._finish(unit, None)

    def _finish(self, unit: WorkUnit, error: BaseException | None) -> None:
        """Finish a unit once and give back its pin (lock held); delivered by _flush. A retried
        piece's error is its request's; its scores went to the request as they came."""
        parent = unit.lineage.parent
        if parent is not None:
            unit.progress.finished = True
            if error is not None:
                self._finish(parent, error)
            return
        if unit.progress.finished:
            return
        unit.progress.finished = True
        if self.batcher is not None:  # a finished unit leaves the queue (one reading its query's rows waits there)
            self.batcher.cancel(unit)
        self._live -= 1
        unit.reply.error = error
        self._cancel_pieces(unit)
        self._release(unit)
        self._done.append(unit)

    def _cancel_pieces(self, unit: WorkUnit) -> None:
        """Lock held: the unit's retried pieces leave the queue with it."""
        for piece in unit.lineage.pieces:
            piece.progress.finished = True
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

    def _call_failed(self, call: Call, err: BaseException, collateral: bool = False) -> None:
        """A call failed: engine/loop/recovery.py retries its work in calls of its own and fails the
        requests whose work failed alone (`collateral`: it failed for an earlier call's fault).
        Raises DeviceFailing when calls keep failing."""
        recovery = self._recovery
        assert recovery is not None
        if recovery.count_failure():
            self._on_device.append(call)  # its requests fail with everything else (_fail_all)
            raise DeviceFailing(f"{recovery.failed_in_a_row} device calls failed in a row") from err
        with self._cv:
            recovery.recover(call, err, collateral)

    def _plan_failed(self, failure: PlanFailed) -> None:
        """Lock held: planning a call failed; isolated as a failed call (engine/loop/recovery.py)."""
        recovery = self._recovery
        assert recovery is not None
        log.error("planning a device call failed", exc_info=failure)
        if recovery.count_failure():
            raise DeviceFailing(f"{recovery.failed_in_a_row} device calls failed in a row") from failure
        recovery.plan_failed(failure)
        self._wake()  # what is left is planned at once, not waited for as a shape to compile

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
