"""The service's core: what both transports call, so that neither imports the other.

gRPC (service/server.py) and HTTP (service/http_api.py) each map their wire format onto
the engine's validation inputs and their status codes onto `Failure`; everything else
is here, once:

- **life**: `start()` loads the model and compiles on the device thread, `become_ready()`
  waits for it, `wait_idle()` lets in-flight requests finish, `stop()`;
- **admission**: `accepting()` hands out the one `Validator` while the service takes work
  (UNAVAILABLE while loading or draining), `validated()` runs it inline or in a thread;
- **run**: `run()` scores a validated request on the device loop and awaits it; streams
  `submit`, `pin`, `cancel` and `release` on the same loop;
- **accounting**: `accounted()` counts every request once (in flight, by status, latency);
- **probe**: readiness and liveness for the admin port and HTTP `/ready`;
- **one error type**: `Failure`, a canonical status code (gRPC's names, which HTTP maps to
  its statuses) with a message for the client and an optional retry hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

from prefixscore.engine.build import build_engine
from prefixscore.engine.loop.admission import QueueFull
from prefixscore.engine.loop.batcher import NonFiniteScores
from prefixscore.engine.loop.device_loop import DeadlineExpired, DeviceWorker, WorkerFailed, WorkerStopped, run_on_done
from prefixscore.engine.loop.page_pins import StreamPin
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import Ticket, WorkUnit
from prefixscore.engine.requests.embedding import EmbeddingRequests
from prefixscore.engine.requests.template_choice import TemplateChoice
from prefixscore.engine.requests.templates import RerankTemplate
from prefixscore.engine.requests.validation import InvalidInput, Limits, RequestTokenizer, Validator
from prefixscore.engine.runtime.scoring_engine import ScoringEngine, WarmupStage
from prefixscore.model.loader import LoadedModel
from prefixscore.service import template_check
from prefixscore.service.config import ServerConfig
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

# a background warm-up compiles on this many threads, niced: requests are being served beside it
# (measured on 2 cores, SmolLM2 from a warm cache: 4 threads at normal priority doubled the first
# request's 2.1 s)
BACKGROUND_COMPILE_THREADS = 2


def peak_host_memory() -> int:
    """The process's peak resident memory in bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StartupFailed(RuntimeError):
    """The model could not be loaded or compiled."""


class Failure(Exception):
    """The one error the core hands a transport: ends a request with `code` (gRPC's canonical
    codes; HTTP maps each to a status) and `message`. `retry_after_ms`: when the client may
    retry (admission refusals), sent as gRPC trailing metadata or an HTTP Retry-After."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


def invalid(err: InvalidInput) -> Failure:
    # INVALID_ARGUMENT also past a size limit: RESOURCE_EXHAUSTED tells clients to retry, and
    # the same request can never succeed (HTTP says 413 for it, from `err.too_large`)
    code = grpc.StatusCode.FAILED_PRECONDITION if err.precondition else grpc.StatusCode.INVALID_ARGUMENT
    return Failure(code, str(err))


def internal_failure(what: str, err: BaseException) -> Failure:
    """INTERNAL that says what failed, not how: paths and device details go to the log only,
    under the request id the client is given to find them."""
    rid = request_ids.current() or request_ids.new_id()
    log.error("%s (request id %s): %s: %s", what, rid, type(err).__name__, err, exc_info=err)
    return Failure(grpc.StatusCode.INTERNAL, f"{what}; request id {rid} (details in the server log)")


def unit_failure(err: BaseException) -> Failure:
    """The status of a unit the device loop finished with an error."""
    if isinstance(err, DeadlineExpired):
        return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
    if isinstance(err, WorkerStopped):
        return Failure(grpc.StatusCode.UNAVAILABLE, str(err))
    if isinstance(err, NonFiniteScores):
        return internal_failure("the model produced non-finite scores (NaN or Inf)", err)
    return internal_failure("the device call failed", err)


@contextlib.contextmanager
def _admission() -> Iterator[None]:
    """Admission control refusals as failures: RESOURCE_EXHAUSTED with a retry hint."""
    try:
        yield
    except QueueFull as full:
        raise Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {full}", full.retry_after_ms) from full
    except WorkerStopped as err:
        raise Failure(grpc.StatusCode.UNAVAILABLE, str(err)) from err


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


def _warmup_report(
    engine: ScoringEngine, report: dict, compiles: int, compile_s: float, started: float
) -> dict[str, Any]:
    """The log fields of a warm-up (or its first stage) since `started` and the counts then."""
    return dict(
        executables=report.get("executables"),
        compilations=CompileCounter.count() - compiles,
        compile_seconds=round(CompileCounter.seconds() - compile_s, 3),
        seconds=round(time.monotonic() - started, 3),
        compile_cache=engine.compile_cache_dir,
    )


class ScoringService:
    """The model, its device loop and the service's state, for any transport; see the module doc.

    `on_failure(error)`: awaited on the event loop once the device loop broke (the process
    must stop, `exit_code` is 1). Use from one asyncio event loop.
    """

    def __init__(self, config: ServerConfig, on_failure: Callable[[BaseException], Awaitable[None]]) -> None:
        self.config = config
        self.metrics = ServiceMetrics()
        self._on_failure = on_failure
        self.template: RerankTemplate | None = None
        self.template_choice = TemplateChoice(None, "not loaded yet")
        self._template_check: asyncio.Future | None = None  # the known-answer check, while it runs
        self.validator: Validator | None = None  # set once ready
        self.embeddings: EmbeddingRequests | None = None  # embedding requests' validation, set with it
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
            peak_host_memory_bytes=peak_host_memory(),
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
        warmed = _warmup_report(engine, report, compiles, compile_s, loaded_at)
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

        def run() -> None:
            compiles, compile_s, started = CompileCounter.count(), CompileCounter.seconds(), time.monotonic()
            try:
                report = engine.compile_stages(
                    stages, BACKGROUND_COMPILE_THREADS, on_stage=stage_ready, stop=self._warming_stop, nice=10
                )
            except Exception as err:
                log.exception("background warm-up failed")
                self._on_worker_failure(err)
                return
            if engine.shapes_ready == self.call_shapes:
                warmed = _warmup_report(engine, report, compiles, compile_s, started)
                event(log, "warmed_up", warmup=True, background=True, **warmed)

        self._warming = threading.Thread(target=run, name="prefixscore-warmup", daemon=True)
        self._warming.start()

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

        async def fail() -> None:
            self.exit_code = 1
            event(log, "worker_failed", level=logging.CRITICAL, error=f"{type(error).__name__}: {error}")
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
        refusal = self.template_choice.refusal() if loaded.tokenizer is not None else ""
        requests = RequestTokenizer(loaded.cfg, loaded.tokenizer, limits)
        self.validator = Validator(requests, self.template, refusal)
        self.embeddings = EmbeddingRequests(requests, loaded.pooling)
        if cfg.warmup:  # the template's known-answer check, once (service/template_check.py)
            check = template_check.run(self.run, self.metrics.template_check_passed, self.validator)
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

    def accepting_embeddings(self) -> EmbeddingRequests:
        """The embedding requests' validation, while the service takes work (as `accepting`)."""
        self.accepting()
        assert self.embeddings is not None  # set with the validator
        return self.embeddings

    def accepting(self) -> Validator:
        """The validator, while the service takes work; else UNAVAILABLE (loading, draining)."""
        if self.draining:
            raise Failure(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if not self.ready or self.validator is None:
            raise Failure(grpc.StatusCode.UNAVAILABLE, "the model is still loading; wait for health SERVING")
        return self.validator

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
        with _admission():
            self.worker.submit(unit)

    def cancel(self, unit: WorkUnit) -> None:
        self.worker.cancel(unit)  # queued items leave the queue

    def pin(self, prefix: tuple[int, ...]) -> StreamPin:
        """Pin a stream's query in the prefix pool and prefill it; raises Failure when refused."""
        with _admission():
            return self.worker.open_prefix(prefix, request_ids.current() or "")

    def release(self, pin: StreamPin) -> None:
        self.worker.release(pin)

    async def run(self, req: TokenizedRequest, method: str, deadline: float | None = None) -> WorkUnit:
        """Score a validated request on the device loop, whatever the transport (gRPC Score and
        Rerank, HTTP /v1/score and /v1/rerank): its items join the same calls as everyone's.
        Returns the finished unit (its reply: scores, cached_tokens); raises Failure."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        unit = self.unit(req, method, deadline)
        unit.reply.on_done = lambda u: _settle(done, u)  # on this loop (_deliver)
        self.submit(unit)
        try:
            await done
        except asyncio.CancelledError:
            self.cancel(unit)
            raise
        if unit.reply.error is not None:
            raise unit_failure(unit.reply.error)
        return unit
