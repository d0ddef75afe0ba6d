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

from prefixscore.engine.batcher import WorkUnit
from prefixscore.engine.buckets import Buckets
from prefixscore.engine.build import EngineSpec, build_engine
from prefixscore.engine.device_loop import (
    DeadlineExpired,
    DeviceWorker,
    NonFiniteScores,
    QueueFull,
    StreamPin,
    WorkerStopped,
    run_on_done,
)
from prefixscore.engine.scoring_engine import ScoringEngine, WarmupStage
from prefixscore.engine.templates import DEFAULT_TEMPLATE, RerankTemplate
from prefixscore.engine.validation import InvalidInput, Limits, RequestTokenizer, TokenizedRequest, Validator
from prefixscore.model.loader import LoadedModel
from prefixscore.model.presets import DEFAULT_MODEL
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


@dataclasses.dataclass
class ServerConfig:
    """Everything `prefixscore serve` can set (see cli.py for the flags and environment variables)."""

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    host: str = "0.0.0.0"
    port: int = 50051  # 0: any free port (see ScoreServer.port)
    metrics_port: int | None = 9090  # None: no metrics endpoint; 0: any free port
    http_port: int | None = None  # the HTTP API (service/http_api.py); None: off; 0: any free port
    template: str = DEFAULT_TEMPLATE  # the reranker prompt template of Rerank and /v1/rerank
    # a causal LM's /v1/classify labels (strings, one token each); a classifier model needs none
    classify_labels: tuple[str, ...] = ()
    max_queue_items: int = 65_536  # admission control: items waiting for the device
    max_items: int = 10_000  # items per request or stream batch
    # the prefix pool on each device: bytes, or (None) a fraction of the device memory left
    # after the weights
    pool_bytes: int | None = None
    pool_memory_fraction: float = 0.5
    compile_cache: str | None = None  # None: $PREFIXSCORE_COMPILE_CACHE_DIR or the user's cache dir; "off"
    drain_seconds: float = 30.0  # how long SIGTERM waits for in-flight RPCs
    warmup: bool = True  # compile every call shape (engine.warmup_stages) ...
    # ... and with serve_early, report SERVING once the first stage is compiled and compile the
    # rest in the background, each stage taken into service when it is ready; else all before
    serve_early: bool = True
    # None: the engine's default for the model's context; or a function of the context
    buckets: Buckets | Callable[[int], Buckets] | None = None
    attn_impl: str | None = None
    # the device mesh (engine/mesh.py): devices on the model axis (tensor parallel) and the data
    # axis (replicas); None: chosen (the smallest model axis the weights fit, the rest data)
    tp_size: int | None = None
    dp_size: int | None = None
    batch_wait_s: float = 0.0  # extra wait before an idle device's first batch, to merge more requests
    max_message_bytes: int = 64 << 20
    # ---- limits against careless or hostile clients (docs/operations.md) ----
    max_queue_tokens: int = 1 << 22  # admission control in item tokens, besides items
    max_request_tokens: int = 1 << 20  # query + items of one request or stream batch
    max_streams: int = 256  # ScoreStreams open at once (each pins its query); past it RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int = 1024  # RPCs in progress, health included; gRPC refuses past it
    stream_idle_timeout_s: float = 120.0  # a stream that sends nothing, or reads nothing, this long is ended
    max_pending_batches: int = 32  # per stream: batches accepted but not yet sent back; past it reading pauses
    keepalive_time_s: float = 60.0  # server pings idle connections this often ...
    keepalive_timeout_s: float = 20.0  # ... and closes those that do not answer within this
    max_connection_idle_s: float = 600.0  # connections without calls are closed after this
    max_connection_age_s: float = 3600.0  # connections are recycled (GOAWAY) after this, to rebalance ...
    max_connection_age_grace_s: float = 60.0  # ... letting their calls finish for this long
    # ---- security ----
    metrics_host: str | None = None  # None: the same as `host`
    reflection: bool = False  # gRPC server reflection (grpcurl without the .proto)
    tls_cert: str | None = None  # PEM files; with both, TLS only (reloaded when they change)
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: clients need a certificate this CA signed
    auth_tokens_file: str | None = None  # bearer tokens, one a line: every call but health needs one
    loaded: LoadedModel | None = None  # a model already in memory (tests, embedding): `model` is not loaded
    engine: ScoringEngine | None = None  # with `loaded`: an engine already built (and compiled) for it

    def engine_spec(self) -> EngineSpec:
        """The engine this configuration serves (engine/build.py)."""
        return EngineSpec(
            self.model,
            self.dtype,
            self.buckets,
            self.attn_impl,
            tp_size=self.tp_size,
            dp_size=self.dp_size,
            pool_bytes=self.pool_bytes,
            pool_memory_fraction=self.pool_memory_fraction,
            compile_cache=self.compile_cache,
        )


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
    return Failure(grpc.StatusCode.INVALID_ARGUMENT, str(err))


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
        self.validator: Validator | None = None  # set once ready
        self.loaded: LoadedModel | None = None
        self.engine: ScoringEngine | None = None
        self.devices: list[str] = []
        self.ready = False
        self.draining = False
        self.started_at = time.time()  # /v1/models' "created"
        self.exit_code = 0  # non-zero: the process must be restarted (the device loop broke)
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
            loaded, engine, load_seconds = cfg.loaded, cfg.engine, 0.0
        else:
            built = build_engine(cfg.engine_spec(), cfg.loaded)
            loaded, engine, load_seconds = built.model, built.engine, built.load_seconds
        loaded_at = time.monotonic()

        self.devices = [f"{d.platform}:{d.id}" for d in engine.devices]
        # a template the model cannot serve (no chat template, labels not single tokens) fails startup
        self.template = RerankTemplate(cfg.template, loaded.tokenizer) if loaded.tokenizer is not None else None
        event(
            log,
            "model_loaded",
            model=loaded.name,
            family=loaded.cfg.family,
            dtype=loaded.dtype,
            context_length=loaded.cfg.context_length,
            # a sliding-window model is served only inside its window, where it is exact
            sliding_window=loaded.cfg.sliding_window,
            devices=self.devices,
            **engine.layout.describe(),
            # the most host memory the process has held so far: loading a checkpoint stays near one
            # stacked weight (each is sent to its shards as it is read), not the whole model
            peak_host_memory_bytes=peak_host_memory(),
            attention=engine.attn_impl,
            seconds=round(load_seconds, 3),
            buckets=dataclasses.asdict(engine.buckets),
            pool_pages=engine.pool_pages,
            pool_bytes=engine.pool_bytes,
            tokenizer=loaded.tokenizer is not None,
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
        warmed = _warmup_report(engine, report, compiles, compile_s, loaded_at)
        if later:
            event(log, "serving_early", call_shapes_ready=engine.shapes_ready, call_shapes=self.call_shapes, **warmed)
            self._warm_in_background(engine, later)
        else:
            event(log, "warmed_up", warmup=cfg.warmup, **warmed)
        self.loaded = loaded
        return engine

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
        self.validator = Validator(RequestTokenizer(loaded.cfg, loaded.tokenizer, limits), self.template)
        mesh = self.engine.layout.shape
        self.metrics.model_info.info(
            dict(
                model=loaded.name,
                family=loaded.cfg.family,
                dtype=loaded.dtype,
                devices=",".join(self.devices),
                tp_size=str(mesh.model),
                dp_size=str(mesh.data),
            )
        )
        self.metrics.mesh_devices.labels("model").set(mesh.model)
        self.metrics.mesh_devices.labels("data").set(mesh.data)
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
        await asyncio.to_thread(self.worker.stop, 30.0)

    def probe(self, path: str) -> str | None:
        """The admin port's probes: None when `path` ("/health": liveness, "/ready": readiness)
        passes, else the reason it does not."""
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
    def unit(req: TokenizedRequest, method: str, deadline: float | None) -> WorkUnit:
        """A validated request as the device loop's unit of work (`deadline`: time.monotonic())."""
        return WorkUnit(
            req.prefix,
            req.items,
            req.label_ids,
            req.apply_softmax,
            req.item_first,
            req.activation,
            method=method,
            deadline=deadline,
            request_id=request_ids.current() or "",
        )

    def submit(self, unit: WorkUnit) -> None:
        """Queue `unit` (its on_done runs on this loop); raises Failure when refused."""
        with _admission():
            self.worker.submit(unit)

    def cancel(self, unit: WorkUnit) -> None:
        self.worker.cancel(unit)  # queued items leave the queue

    def pin(self, prefix: tuple[int, ...]) -> StreamPin:
        """Pin a stream's query in the prefix pool and prefill it; raises Failure when refused."""
        with _admission():
            return self.worker.open_prefix(prefix)

    def release(self, pin: StreamPin) -> None:
        self.worker.release(pin)

    async def run(self, req: TokenizedRequest, method: str, deadline: float | None = None) -> WorkUnit:
        """Score a validated request on the device loop, whatever the transport (gRPC Score and
        Rerank, HTTP /v1/score and /v1/rerank): its items join the same calls as everyone's.
        Returns the finished unit (scores, cached_tokens); raises Failure."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        unit = self.unit(req, method, deadline)
        unit.on_done = lambda u: _settle(done, u)  # on this loop (_deliver)
        self.submit(unit)
        try:
            await done
        except asyncio.CancelledError:
            self.cancel(unit)
            raise
        if unit.error is not None:
            raise unit_failure(unit.error)
        return unit
