"""The service's core: what both transports call, so that neither imports the other.

gRPC (service/server.py) and HTTP (service/http_api.py) each map their wire format onto a
request kind's input (engine/requests/kind.py) and the core's `Failure` (service/failures.py)
onto their status codes; everything else is here, once:

- **life**: `start()` loads the model and compiles on the device thread, `become_ready()`
  waits for it, `wait_idle()` lets in-flight requests finish, `stop()`;
- **admission**: `accepting()` hands out the kinds served while the service takes work
  (UNAVAILABLE while loading or draining);
- **serve**: `serve()` validates and plans a request of any kind, runs its requests on the
  device loop and answers it; streams `submit`, `pin`, `cancel` and `release` on the same loop;
- **accounting**: `accounted()` counts every request once (in flight, by status, latency);
- **probe**: readiness and liveness for the admin port and HTTP `/ready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

from prefixscore.engine.build import build_engine
from prefixscore.engine.loop.device_loop import DeviceWorker, WorkerFailed, run_on_done
from prefixscore.engine.loop.page_pins import StreamPin
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import Ticket, WorkUnit
from prefixscore.engine.requests import catalog
from prefixscore.engine.requests.catalog import Kinds
from prefixscore.engine.requests.kind import Done, RequestKind, Served, served, to_run
from prefixscore.engine.requests.template_choice import TemplateChoice
from prefixscore.engine.requests.templates import RerankTemplate
from prefixscore.engine.requests.validation import Limits
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.engine.runtime.warmup import WarmupStage
from prefixscore.model.loader import LoadedModel
from prefixscore.service import template_check, warmup
from prefixscore.service.config import ServerConfig
from prefixscore.service.failures import Failure, StartupFailed, admission, unit_failure
from prefixscore.service.group_watch import GroupWatch
from prefixscore.service.served_model import ServedModel
from prefixscore.telemetry import request_ids
from prefixscore.telemetry.compiles import CompileCounter
from prefixscore.telemetry.logs import event
from prefixscore.telemetry.metrics import ServiceMetrics

log = logging.getLogger("prefixscore.server")

# a request message up to this size is validated (and tokenized) on the event loop: that takes
# well under a millisecond, less than the hop to a worker thread and back costs the host;
# larger ones go to a thread so the loop keeps serving everyone else meanwhile
INLINE_VALIDATION_BYTES = 32 << 10


async def validated(size: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) (validation and tokenization) inline for a request of `size` bytes up to
    INLINE_VALIDATION_BYTES, else in a thread; `size` None (unknown): in a thread."""
    if size is not None and size <= INLINE_VALIDATION_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclasses.dataclass
class Outcome:
    """How a request ended, for its count: a gRPC code name, set by the transport."""

    status: str = "OK"


def _settle(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


class ScoringService:
    """The model, its device loop and the service's state, for any transport; see the module doc.

    `on_failure(error)`: awaited on the event loop once the device loop broke (the process
    must stop, `exit_code` is 1). `on_group_lost()`: called at once, on the thread that noticed,
    when a host of the group is lost (before the requests held are failed). Use from one asyncio
    event loop.
    """

    def __init__(
        self,
        config: ServerConfig,
        on_failure: Callable[[BaseException], Awaitable[None]],
        on_group_lost: Callable[[], None],
    ) -> None:
        self.config = config
        self.metrics = ServiceMetrics()
        self._on_failure = on_failure
        self._on_group_lost = on_group_lost
        self.template: RerankTemplate | None = None
        self.template_choice = TemplateChoice(None, "not loaded yet")
        self._template_check: asyncio.Future | None = None  # the known-answer check, while it runs
        self.kinds: Kinds | None = None  # the kinds served and their validation, set once ready
        self.loaded: LoadedModel | None = None
        self.engine: ScoringEngine | None = None
        self.served: ServedModel | None = None  # what is served, once loaded (service/served_model.py)
        self.ready = False
        self.draining = False
        self.started_at = time.time()  # /v1/models' "created"
        self.exit_code = 0  # non-zero: the process must be restarted (the device loop broke)
        # several hosts, on the leader: waiting for the followers, watching them, their loss
        self.group = GroupWatch(self.metrics, self._fail_now)
        self._failing = False  # the device loop broke (or the group was lost): stopping once
        self.call_shapes = 0  # call shapes warm-up compiles (engine.shapes_ready: how many are)
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._warming_stop = threading.Event()  # ends a background warm-up at shutdown
        self._warming: threading.Thread | None = None  # the background warm-up, while it runs
        CompileCounter.install()  # count the compilations of loading and warm-up too
        self.worker = DeviceWorker(
            self._startup,
            self.metrics,
            config.max_queue_items,
            on_ready=self._on_worker_ready,
            batch_wait_s=config.batch_wait_s,
            max_queue_tokens=config.max_queue_tokens,
            on_failure=self._on_worker_failure,
            deliver=self._deliver,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker_ready: asyncio.Future | None = None

    # ---- life --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start loading the model and compiling on the device thread (see `become_ready`)."""
        self._loop = asyncio.get_running_loop()
        self._worker_ready = self._loop.create_future()
        self.worker.start()

    def _startup(self) -> ScoringEngine:
        """On the device thread: load weights, build the engine, compile the buckets."""
        cfg = self.config
        if cfg.engine is not None:  # built (and compiled) by the caller, for its `loaded`
            if cfg.loaded is None:
                raise StartupFailed("ServerConfig.engine is given without the model it was built for (loaded)")
            loaded, engine, load_seconds, steps = cfg.loaded, cfg.engine, 0.0, None
        else:
            built = build_engine(cfg.engine_spec(), cfg.loaded)
            loaded, engine, load_seconds, steps = built.model, built.engine, built.load_seconds, built.steps
        loaded_at = time.monotonic()

        # `auto` recognizes a published reranker or serves rerank none; a template the model cannot
        # serve (no chat template, labels not single tokens) fails startup
        self.template, self.template_choice = template_check.at_start(cfg.template, loaded)
        self.served = ServedModel.of(loaded, engine, self.template_choice)
        event(
            log,
            "model_loaded",
            **self.served.log_fields(),
            # the most host memory the process has held so far: loading a checkpoint stays near one
            # stacked weight (each is sent to its shards as it is read), not the whole model
            peak_host_memory_bytes=warmup.peak_host_memory(),
            seconds=round(load_seconds, 3),
        )
        compiles, compile_s = CompileCounter.count(), CompileCounter.seconds()
        stages = engine.warmup_stages() if cfg.warmup else []
        self.call_shapes = sum(len(stage.shapes) for stage in stages)
        # compiled before SERVING: every stage, or with serve_early the first, which serves any
        # request whose items fit its bucket; traffic never waits for a shape it does not need
        now, later = (stages[:1], stages[1:]) if cfg.serve_early else (stages, [])
        report = engine.compile_stages(now) if now else {}
        self.metrics.call_shapes.labels("compiled").set(engine.shapes_ready)
        self.metrics.call_shapes.labels("all").set(self.call_shapes)
        # the kernels against the oracle on this very device: never serve a miscompiled kernel
        event(log, "attention_checked", attention=engine.attn_impl, max_abs_error=engine.check_attention())
        self.group.wait_ready(steps)
        warmed = warmup.report(engine, report, compiles, compile_s, loaded_at)
        if later:
            event(log, "serving_early", call_shapes_ready=engine.shapes_ready, call_shapes=self.call_shapes, **warmed)
            self._warm_in_background(engine, later)
        else:
            event(log, "warmed_up", warmup=cfg.warmup, **warmed)
        self.loaded = loaded
        return engine

    def _fail_now(self, error: WorkerFailed) -> None:
        """From any thread, when no call can complete (a host of the group lost): every request
        queued or on the device fails now with `error` (the device thread may be waiting in a
        collective that never completes), and the process stops with a non-zero exit."""
        self.draining = True  # what arrives from now on (a client's retry, too) is refused UNAVAILABLE
        self._on_group_lost()
        self.worker.abandon(error)
        self._on_worker_failure(error)

    def _warm_in_background(self, engine: ScoringEngine, stages: list[WarmupStage]) -> None:
        """Compile the later warm-up stages on a thread of their own while serving; each stage
        is planned into as soon as it is compiled. A stage that fails to compile is a broken
        device loop (the work waiting for its shapes would never run): the process restarts."""

        def stage_ready() -> None:
            self.metrics.call_shapes.labels("compiled").set(engine.shapes_ready)
            event(log, "warmup_stage", call_shapes_ready=engine.shapes_ready, call_shapes=self.call_shapes)
            self.worker.shapes_changed()

        self._warming = warmup.in_background(
            engine, stages, self.call_shapes, self._warming_stop, stage_ready, self._on_worker_failure
        )

    @property
    def compiling_in_background(self) -> bool:
        """Whether a background warm-up still runs (a compile in progress cannot be interrupted)."""
        return self._warming is not None and self._warming.is_alive()

    def _on_worker_ready(self, error: BaseException | None) -> None:
        """From the device thread, once: hand the outcome to the event loop."""
        assert self._loop is not None and self._worker_ready is not None
        future = self._worker_ready

        def settle() -> None:
            if not future.done():
                future.set_result(error)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(settle)

    def _on_worker_failure(self, error: BaseException) -> None:
        """From the device thread: the device loop broke. Not serving any more: the process
        stops with a non-zero exit so the orchestrator restarts it."""
        assert self._loop is not None
        if self._failing:  # a lost group fails the loop too: stop once
            return
        self._failing = True
        self.exit_code = 1
        # said on the thread that noticed: a lost group's backstop may end the process before the
        # event loop runs `fail`, and its exit must not be the only line saying it stopped
        event(log, "worker_failed", level=logging.CRITICAL, error=f"{type(error).__name__}: {error}")

        async def fail() -> None:
            await self._on_failure(error)

        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending anyway
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(fail()))

    async def become_ready(self) -> None:
        """Wait for the model; then take work. Raises StartupFailed if it could not be loaded."""
        assert self._worker_ready is not None, "start() first"
        error = await self._worker_ready
        if error is not None:
            event(log, "startup_failed", level=logging.ERROR, error=f"{type(error).__name__}: {error}")
            raise StartupFailed(f"{type(error).__name__}: {error}") from error
        assert self.loaded is not None and self.worker.engine is not None
        self.engine = self.worker.engine
        loaded = self.loaded
        # the Scorer's limits (sequences within the compiled buckets), and no request larger than the queue
        cfg = self.config
        limits = Limits.for_engine(
            self.engine,
            max_items=min(cfg.max_items, cfg.max_queue_items),
            max_request_tokens=min(cfg.max_request_tokens, cfg.max_queue_tokens),
        )
        self.kinds = catalog.for_model(loaded, limits, self.template, self.template_choice)
        if cfg.warmup:  # the template's known-answer check, once (service/template_check.py)
            check = template_check.run(self.serve, self.metrics.template_check_passed, self.kinds["rerank"])  # type: ignore[arg-type]
            self._template_check = asyncio.ensure_future(check)
        assert self.served is not None
        self.metrics.model_info.info(self.served.metric_labels())
        self.metrics.mesh_devices.labels("model").set(self.served.tp_size)
        self.metrics.mesh_devices.labels("data").set(self.served.dp_size)
        self.ready = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (False: `timeout` passed first)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Stop taking work and stop the device loop (what is queued fails UNAVAILABLE)."""
        self.draining = True
        self._warming_stop.set()
        if self._template_check is not None:
            self._template_check.cancel()
        # a lost group's device thread may wait in a collective forever: do not wait for it
        await asyncio.to_thread(self.worker.stop, 1.0 if self.group.lost else 30.0)
        await asyncio.to_thread(self.group.stop)

    def probe(self, path: str) -> str | None:
        """The admin port's probes: None when `path` ("/health": liveness, "/ready": readiness)
        passes, else the reason it does not."""
        if self.group.lost:
            return f"failed: a host of the group was lost ({self.group.lost}); the process is exiting"
        if self.exit_code:
            return "failed: the device loop broke; the process is exiting"
        if path == "/ready":
            if self.draining:
                return "draining"
            if not self.ready:
                return "loading"
        return None

    # ---- requests ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accounted(self, method: str) -> Iterator[Outcome]:
        """A request of any transport counted once: in flight (drain waits for it), then by
        status and latency. The caller sets the outcome's status to a gRPC code name."""
        started = time.monotonic()
        self.inflight += 1
        self._idle.clear()
        self.metrics.inflight.inc()
        outcome = Outcome()
        try:
            yield outcome
        finally:
            self.metrics.inflight.dec()
            self.metrics.requests.labels(method, outcome.status).inc()
            self.metrics.request_seconds.labels(method).observe(time.monotonic() - started)
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    def accepting(self) -> Kinds:
        """The kinds served, while the service takes work; else UNAVAILABLE (loading, draining)."""
        if self.draining:
            raise Failure(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if not self.ready or self.kinds is None:
            raise Failure(grpc.StatusCode.UNAVAILABLE, "the model is still loading; wait for health SERVING")
        return self.kinds

    def _deliver(self, units: list[WorkUnit]) -> None:
        """The worker's finished units (one device call's): one wake-up of the event loop for
        all of them, where their on_done runs (it settles futures that live on this loop)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(run_on_done, units)

    @staticmethod
    def unit(req: TokenizedRequest, method: str, deadline: float | None, counts_lookup: bool = True) -> WorkUnit:
        """A validated request as the device loop's unit of work (`deadline`: time.monotonic();
        `counts_lookup`: False for a stream's batch, whose open counted its prefix-cache lookup)."""
        rid = request_ids.current() or ""
        return WorkUnit(req, Ticket(method=method, request_id=rid, deadline=deadline, counts_lookup=counts_lookup))

    def submit(self, unit: WorkUnit) -> None:
        """Queue `unit` (its on_done runs on this loop); raises Failure when refused."""
        with admission():
            self.worker.submit(unit)

    def cancel(self, unit: WorkUnit) -> None:
        self.worker.cancel(unit)  # queued items leave the queue

    def pin(self, prefix: tuple[int, ...]) -> StreamPin:
        """Pin a stream's query in the prefix pool and prefill it; raises Failure when refused."""
        with admission():
            return self.worker.open_prefix(prefix, request_ids.current() or "")

    def release(self, pin: StreamPin) -> None:
        self.worker.release(pin)

    def _queued_together(
        self, requests: list[TokenizedRequest], method: str, deadline: float | None
    ) -> list[tuple[WorkUnit, asyncio.Future]]:
        """Queue a request's engine requests at once, each with the future its unit settles (on this
        loop): the device loop plans no call while they are being queued, so those that fit one call
        ride in one (queued one by one, a call could start with a request's first few prompts and
        leave the rest to a call of their own). Raises Failure when one is refused, the others then
        withdrawn."""
        loop = asyncio.get_running_loop()
        queued: list[tuple[WorkUnit, asyncio.Future]] = []
        with self.worker.paused():
            try:
                for req in requests:
                    done = loop.create_future()
                    unit = self.unit(req, method, deadline)
                    unit.reply.on_done = lambda u, done=done: _settle(done, u)  # on this loop (_deliver)
                    self.submit(unit)
                    queued.append((unit, done))
            except BaseException:
                for unit, _ in queued:
                    self.cancel(unit)
                raise
        return queued

    async def serve(
        self, kind: RequestKind, inp: Any, method: str, size: int | None = None, deadline: float | None = None
    ) -> Served:
        """A request of any kind, whatever the transport: validated and planned (inline or in a
        thread, by its `size` in bytes), its requests run side by side on the device loop (their
        items join the same calls as everyone's), then answered by its kind. Raises Failure, or
        InvalidInput naming the field before any device work."""
        plan = await validated(size, kind.plan, inp)
        queued = self._queued_together(to_run(plan), method, deadline)
        try:
            await asyncio.gather(*(done for _, done in queued))
        except asyncio.CancelledError:
            for unit, _ in queued:
                self.cancel(unit)
            raise
        failed = next((u.reply.error for u, _ in queued if u.reply.error is not None), None)
        if failed is not None:
            raise unit_failure(failed)
        return served(kind, plan, [Done.of(u) for u, _ in queued])
