"""The gRPC server: `prefixscore.v1.ScoreService` on grpc.aio, plus grpc.health.v1.Health,
server reflection, and Prometheus metrics on their own port.

Life cycle: `start()` listens at once with health NOT_SERVING, then the device
worker loads the model and compiles (warm-up) on its own thread; health turns
SERVING when that is done. `drain()` (SIGTERM) turns health NOT_SERVING,
refuses new RPCs with UNAVAILABLE, lets in-flight RPCs and open streams finish
(up to a timeout), then stops the server and the worker.

Handlers do validation and tokenization off the event loop (a thread), hand
token ids to the worker as `WorkUnit`s, and await their results; they never
touch the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixscore.engine.batcher import WorkUnit
from prefixscore.engine.buckets import Buckets
from prefixscore.engine.device_loop import (
    DeadlineExpired,
    DeviceWorker,
    NonFiniteScores,
    QueueFull,
    StreamPin,
    WorkerStopped,
    run_on_done,
)
from prefixscore.engine.executables import CompileCounter, ScoringEngine, WarmupStage
from prefixscore.engine.templates import DEFAULT_TEMPLATE, RerankTemplate, ranked
from prefixscore.engine.validation import InvalidInput, Limits, RequestTokenizer, TokenizedRequest
from prefixscore.model.loader import LoadedModel, load_model
from prefixscore.model.presets import DEFAULT_MODEL
from prefixscore.service import prefix_key, request_ids, security
from prefixscore.service.logs import event
from prefixscore.service.metrics import ServiceMetrics, serve_metrics
from prefixscore.service.wire import RequestConverter, RpcFailure, StreamSpec, invalid, item_scores, parse, usage
from prefixscore.v1 import score_service_pb2 as pb

log = logging.getLogger("prefixscore.server")

try:  # what grpc.aio raises when a message is written on a call that has already ended
    from grpc._cython.cygrpc import ExecuteBatchError as _CallEnded
except ImportError:  # pragma: no cover (another grpcio layout: such writes count as INTERNAL)
    _CallEnded = type("_CallEnded", (Exception,), {})

# a request message up to this size is validated (and tokenized) on the event loop: that takes
# well under a millisecond, less than the hop to a worker thread and back costs the host;
# larger ones go to a thread so the loop keeps serving everyone else meanwhile
INLINE_VALIDATION_BYTES = 32 << 10

# a background warm-up compiles on this many threads, niced: requests are being served beside it
# (measured on 2 cores, SmolLM2 from a warm cache: 4 threads at normal priority doubled the first
# request's 2.1 s)
BACKGROUND_COMPILE_THREADS = 2

SERVICE = pb.DESCRIPTOR.services_by_name["ScoreService"].full_name  # "prefixscore.v1.ScoreService"
RETRY_AFTER_KEY = "retry-after-ms"


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
    max_queue_items: int = 65_536  # admission control: items waiting for the device
    max_items: int = 10_000  # items per request or stream batch
    # the prefix pool: bytes, or (None) a fraction of the device memory left after the weights
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


class StartupFailed(RuntimeError):
    """The model could not be loaded or compiled."""


def internal_failure(what: str, err: BaseException) -> RpcFailure:
    """INTERNAL that says what failed, not how: paths and device details go to the log only,
    under the request id the client is given to find them."""
    rid = request_ids.current() or request_ids.new_id()
    log.error("%s (request id %s): %s: %s", what, rid, type(err).__name__, err, exc_info=err)
    return RpcFailure(grpc.StatusCode.INTERNAL, f"{what}; request id {rid} (details in the server log)")


def _unit_failure(err: BaseException) -> RpcFailure:
    if isinstance(err, DeadlineExpired):
        return RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
    if isinstance(err, WorkerStopped):
        return RpcFailure(grpc.StatusCode.UNAVAILABLE, str(err))
    if isinstance(err, NonFiniteScores):
        return internal_failure("the model produced non-finite scores (NaN or Inf)", err)
    return internal_failure("the device call failed", err)


@contextlib.contextmanager
def _admission() -> Iterator[None]:
    """Admission control refusals as gRPC statuses: RESOURCE_EXHAUSTED with a retry hint."""
    try:
        yield
    except QueueFull as full:
        raise RpcFailure(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {full}", ((RETRY_AFTER_KEY, str(full.retry_after_ms)),)
        ) from full
    except WorkerStopped as err:
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, str(err)) from err


class _InitialMetadata:
    """An RPC's initial metadata: its request id, and its prefix key once the request is parsed
    (service/prefix_key.py). Sent once, before the first response or the status: a handler
    sends it as soon as it knows the key, the wrapper otherwise."""

    def __init__(self, context: grpc.aio.ServicerContext, rid: str) -> None:
        self.context = context
        self.rid = rid
        self.sent = False

    async def send(self, key: str | None = None) -> None:
        if self.sent:
            return
        self.sent = True
        pairs = ((request_ids.HEADER, self.rid),) + (((prefix_key.HEADER, key),) if key else ())
        try:
            await self.context.send_initial_metadata(pairs)
        except Exception as err:  # noqa: BLE001 - the call ended first (deadline, cancel, a client gone)
            # nothing can reach the client any more; what ended the call is its status, not this
            log.debug("initial metadata not sent, the call had ended: %s: %s", type(err).__name__, err)


_ECHO: contextvars.ContextVar[_InitialMetadata] = contextvars.ContextVar("prefixscore_initial_metadata")


async def echo_prefix_key(key: str) -> None:
    """Send the running RPC's initial metadata with its prefix key (see _InitialMetadata)."""
    await _ECHO.get().send(key)


def _input_key(query: pb.Input) -> str:
    return prefix_key.for_score(query.text if query.WhichOneof("kind") == "text" else query.token_ids.ids)


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


def _rpc(method: str) -> Callable:
    """Wrap a handler: metrics (requests by code, latency, in-flight) and error -> status mapping."""

    def decorate(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def handler(self: ScoreServer, request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._observe(method, fn, request, context)

        return handler

    return decorate


class ScoreServer:
    """One ScoreService server; see the module doc. Use from one asyncio event loop."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServiceMetrics()
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.template: RerankTemplate | None = None
        self.ready = False
        self.draining = False
        self.started_at = time.time()  # /v1/models' "created"
        self.exit_code = 0  # non-zero: the process must be restarted (the device loop broke)
        self._streams = 0
        self.loaded: LoadedModel | None = None
        self.engine: ScoringEngine | None = None
        self.converter: RequestConverter | None = None
        self.devices: list[str] = []
        self._server: grpc.aio.Server | None = None
        self._metrics_httpd: Any = None
        self._http: Any = None  # http_api.HttpServer when http_port is set
        self._inflight = 0
        self.call_shapes = 0  # call shapes warm-up compiles (engine.shapes_ready: how many are)
        self._warming_stop = threading.Event()  # ends a background warm-up at shutdown
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = asyncio.Event()
        self._ready_task: asyncio.Task | None = None
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

    # ---- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen (health NOT_SERVING), start the metrics endpoint, and start loading the model."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._worker_ready = self._loop.create_future()
        tokens = security.TokenFile(cfg.auth_tokens_file) if cfg.auth_tokens_file else None
        ms = lambda seconds: int(seconds * 1000)  # noqa: E731
        server = grpc.aio.server(
            interceptors=[security.BearerTokenInterceptor(tokens)] if tokens else None,
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a taken port is an error, not a silently shared one
                # dead peers and half-open connections are found and closed; a load balancer
                # gets a chance to rebalance long-lived connections
                ("grpc.keepalive_time_ms", ms(cfg.keepalive_time_s)),
                ("grpc.keepalive_timeout_ms", ms(cfg.keepalive_timeout_s)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.max_connection_idle_ms", ms(cfg.max_connection_idle_s)),
                ("grpc.max_connection_age_ms", ms(cfg.max_connection_age_s)),
                ("grpc.max_connection_age_grace_ms", ms(cfg.max_connection_age_grace_s)),
            ],
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        )
        raw = dict(request_deserializer=None)  # handlers parse, to answer bad bytes with INVALID_ARGUMENT
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Score": grpc.unary_unary_rpc_method_handler(
                            self.score, response_serializer=pb.ScoreResponse.SerializeToString, **raw
                        ),
                        "ScoreStream": grpc.stream_stream_rpc_method_handler(
                            self.score_stream, response_serializer=pb.ScoreStreamResponse.SerializeToString, **raw
                        ),
                        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                            self.get_model_info, response_serializer=pb.GetModelInfoResponse.SerializeToString, **raw
                        ),
                        "Rerank": grpc.unary_unary_rpc_method_handler(
                            self.rerank, response_serializer=pb.RerankResponse.SerializeToString, **raw
                        ),
                    },
                ),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if cfg.reflection:
            reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key")
            creds = security.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
            self.port = server.add_secure_port(address, creds)
        elif cfg.tls_client_ca:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        self._server = server
        if cfg.metrics_port is not None:
            host = cfg.metrics_host or cfg.host
            self._metrics_httpd = serve_metrics(host, cfg.metrics_port, self.metrics.registry, self.probe)
            self.metrics_port = self._metrics_httpd.server_port
        if cfg.http_port is not None:
            from prefixscore.service.http_api import HttpServer  # the ASGI stack loads only when asked for

            tls = security.http_ssl_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
            self._http = HttpServer(self, cfg.host, cfg.http_port, tokens, tls)
            self.http_port = await self._http.start()
        event(
            log,
            "listening",
            host=cfg.host,
            port=self.port,
            metrics_port=self.metrics_port,
            http_port=self.http_port,
            tls=bool(cfg.tls_cert),
            mutual_tls=bool(cfg.tls_client_ca),
            auth_tokens=tokens is not None,
            reflection=cfg.reflection,
        )
        self.worker.start()
        self._ready_task = asyncio.ensure_future(self._become_ready())

    def _startup(self) -> ScoringEngine:
        """On the device thread: load weights, build the engine, compile the buckets."""
        cfg = self.config
        started = time.monotonic()
        loaded = cfg.loaded or load_model(cfg.model, cfg.dtype)
        loaded_at = time.monotonic()
        if cfg.engine is not None:
            engine = cfg.engine
        else:
            buckets = cfg.buckets(loaded.cfg.max_position_embeddings) if callable(cfg.buckets) else cfg.buckets
            engine = ScoringEngine(
                loaded.cfg,
                loaded.params,
                loaded.dtype,
                buckets,
                cfg.attn_impl,
                compile_cache_dir=cfg.compile_cache,
                pool_bytes=cfg.pool_bytes,
                pool_memory_fraction=cfg.pool_memory_fraction,
            )

        self.devices = [f"{d.platform}:{d.id}" for d in engine.devices]
        # a template the model cannot serve (no chat template, labels not single tokens) fails startup
        self.template = RerankTemplate(cfg.template, loaded.tokenizer) if loaded.tokenizer is not None else None
        event(
            log,
            "model_loaded",
            model=loaded.name,
            family=loaded.cfg.family,
            dtype=loaded.dtype,
            devices=self.devices,
            attention=engine.attn_impl,
            seconds=round(loaded_at - started, 3),
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

        threading.Thread(target=run, name="prefixscore-warmup", daemon=True).start()

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
        """From the device thread: the device loop broke. Not serving any more: health
        NOT_SERVING at once, then stop with a non-zero exit so the orchestrator restarts us."""
        assert self._loop is not None

        async def fail() -> None:
            self.exit_code = 1
            event(log, "worker_failed", level=logging.CRITICAL, error=f"{type(error).__name__}: {error}")
            for name in ("", SERVICE):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.stop()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending anyway
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(fail()))

    async def _become_ready(self) -> None:
        assert self._worker_ready is not None
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
        self.converter = RequestConverter(RequestTokenizer(loaded.cfg, loaded.tokenizer, limits), self.template)
        self.metrics.model_info.info(
            dict(model=loaded.name, family=loaded.cfg.family, dtype=loaded.dtype, devices=",".join(self.devices))
        )
        self.ready = True
        if not self.draining:
            for name in ("", SERVICE):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        event(log, "ready", model=loaded.name, port=self.port, metrics_port=self.metrics_port)

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

    async def wait_ready(self) -> None:
        """Return once SERVING; raises StartupFailed if the model could not be loaded."""
        assert self._ready_task is not None, "start() first"
        await asyncio.shield(self._ready_task)

    async def drain(self, timeout: float | None = None) -> None:
        """Graceful stop: health NOT_SERVING, refuse new RPCs, finish in-flight ones, stop."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        timeout = self.config.drain_seconds if timeout is None else timeout
        event(log, "draining", inflight=self._inflight, queued_items=self.worker.depth, timeout_s=timeout)
        await self.health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            event(log, "drain_timeout", level=logging.WARNING, inflight=self._inflight)
        await self.stop()

    async def stop(self) -> None:
        """Stop at once: cancel what is in flight, stop the worker and the metrics endpoint."""
        self.draining = True
        self._warming_stop.set()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._http is not None:
            await self._http.stop()
            self._http = None
        await asyncio.to_thread(self.worker.stop, 30.0)
        if self._metrics_httpd is not None:
            await asyncio.to_thread(self._metrics_httpd.shutdown)
            self._metrics_httpd.server_close()
            self._metrics_httpd = None
        if self._ready_task is not None and not self._ready_task.done():
            self._ready_task.cancel()
        event(log, "stopped")
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # ---- RPC plumbing ----------------------------------------------------------------------------
    async def _observe(self, method: str, fn: Callable, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # the client's x-request-id (or a new one): in every log line, echoed in the initial metadata
        sent = dict(context.invocation_metadata() or ()).get(request_ids.HEADER)
        with request_ids.bound(request_ids.accept(sent)) as rid:
            echo = _InitialMetadata(context, rid)
            token = _ECHO.set(echo)
            try:
                return await self._observe_bound(method, fn, request, context, echo)
            finally:
                _ECHO.reset(token)

    async def _observe_bound(
        self, method: str, fn: Callable, request: Any, context: grpc.aio.ServicerContext, echo: _InitialMetadata
    ) -> Any:
        with self.accounted(method) as status:
            try:
                response = await fn(self, request, context)
                await echo.send()
                return response
            except RpcFailure as failure:
                status[0] = failure.code.name
                await echo.send()
                await context.abort(failure.code, failure.message, trailing_metadata=failure.trailers)
            except InvalidInput as err:
                failure = invalid(err)
                status[0] = failure.code.name
                await echo.send()
                await context.abort(failure.code, failure.message)
            except asyncio.CancelledError:
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= 0
                status[0] = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
                raise
            except Exception as err:
                status[0] = "INTERNAL"
                await echo.send()
                await context.abort(grpc.StatusCode.INTERNAL, internal_failure(f"{method} failed", err).message)

    @contextlib.contextmanager
    def accounted(self, method: str) -> Iterator[list[str]]:
        """A request of any transport (gRPC, HTTP) counted once: in flight (drain waits for
        it), then by status and latency. The caller sets `status[0]` to a gRPC code name."""
        started = time.monotonic()
        self._inflight += 1
        self._idle.clear()
        self.metrics.inflight.inc()
        status = ["OK"]
        try:
            yield status
        finally:
            self.metrics.inflight.dec()
            self.metrics.requests.labels(method, status[0]).inc()
            self.metrics.request_seconds.labels(method).observe(time.monotonic() - started)
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _check_accepting(self) -> RequestConverter:
        if self.draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if not self.ready or self.converter is None:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the model is still loading; wait for health SERVING")
        return self.converter

    def _deliver(self, units: list[WorkUnit]) -> None:
        """The worker's finished units (one device call's): one wake-up of the event loop for
        all of them, where their on_done runs (it settles futures that live on this loop)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(run_on_done, units)

    def _submit(self, unit: WorkUnit) -> None:
        with _admission():
            self.worker.submit(unit)

    def _pin(self, prefix: tuple[int, ...]) -> StreamPin:
        with _admission():
            return self.worker.open_prefix(prefix)

    @staticmethod
    def _deadline(context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    @staticmethod
    def _unit(req: TokenizedRequest, method: str, deadline: float | None) -> WorkUnit:
        return WorkUnit(
            req.prefix, req.items, req.label_ids, req.apply_softmax, req.item_first, method=method, deadline=deadline
        )

    async def run(self, req: TokenizedRequest, method: str, deadline: float | None = None) -> WorkUnit:
        """Score a validated request on the device worker, whatever the transport (gRPC Score and
        Rerank, HTTP /v1/score and /v1/rerank): its items join the same batches as everyone's.
        Returns the finished unit (scores, cached_tokens); raises RpcFailure."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        unit = self._unit(req, method, deadline)
        unit.on_done = lambda u: _settle(done, u)  # on this loop (_deliver)
        self._submit(unit)
        try:
            await done
        except asyncio.CancelledError:
            self.worker.cancel(unit)  # queued items leave the queue
            raise
        if unit.error is not None:
            raise _unit_failure(unit.error)
        return unit

    # ---- Score -----------------------------------------------------------------------------------
    @_rpc("Score")
    async def score(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        msg = parse(pb.ScoreRequest, raw)
        await echo_prefix_key(_input_key(msg.query))
        converter = self._check_accepting()
        checked = await validated(len(raw), converter.score_request, msg)
        req = checked.request
        differs = checked.joined_differs or []
        if not req.items:
            return pb.ScoreResponse(usage=pb.Usage(), label_token_ids=req.label_ids)
        unit = await self.run(req, "Score", self._deadline(context))
        return pb.ScoreResponse(
            scores=item_scores(unit.scores),
            usage=usage(req, unit.cached_tokens, checked.truncation),
            label_token_ids=req.label_ids,
            joined_tokenization_differs=differs,
        )

    # ---- Rerank ----------------------------------------------------------------------------------
    @_rpc("Rerank")
    async def rerank(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        msg = parse(pb.RerankRequest, raw)
        await echo_prefix_key(prefix_key.for_rerank(msg.query, msg.instruction))
        converter = self._check_accepting()
        checked = await validated(len(raw), converter.rerank_request, msg)
        req = checked.scored.request
        template = self.template.name if self.template else ""
        if not req.items:
            return pb.RerankResponse(usage=pb.Usage(), template=template)
        unit = await self.run(req, "Rerank", self._deadline(context))
        differs = checked.scored.joined_differs
        results = [
            pb.RerankResult(
                index=r.index,
                relevance_score=r.relevance_score,
                document=checked.documents[r.index] if msg.return_documents else "",
                joined_tokenization_differs=bool(differs and differs[r.index]),
            )
            for r in ranked(unit.scores, checked.top_n)
        ]
        return pb.RerankResponse(
            results=results, usage=usage(req, unit.cached_tokens, checked.scored.truncation), template=template
        )

    # ---- ScoreStream -----------------------------------------------------------------------------
    @_rpc("ScoreStream")
    async def score_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        self._check_accepting()
        if self._streams >= self.config.max_streams:
            self.metrics.rejected.inc()
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server busy: {self._streams} streams are open (limit {self.config.max_streams}); retry later",
                ((RETRY_AFTER_KEY, "1000"),),
            )
        session = _StreamSession(self, context)
        self._streams += 1
        self.metrics.open_streams.inc()
        try:
            await session.run(requests)
        finally:
            self._streams -= 1
            self.metrics.open_streams.dec()
            session.close()

    # ---- GetModelInfo ----------------------------------------------------------------------------
    @_rpc("GetModelInfo")
    async def get_model_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        parse(pb.GetModelInfoRequest, raw)
        self._check_accepting()  # draining: UNAVAILABLE like every call, so clients go elsewhere
        assert self.loaded is not None and self.converter is not None
        from prefixscore import __version__

        cfg = self.config

        loaded, limits, conv = self.loaded, self.converter.requests.limits, self.converter
        return pb.GetModelInfoResponse(
            model=loaded.name,
            family=loaded.cfg.family,
            vocab_size=loaded.cfg.vocab_size,
            context_length=loaded.cfg.max_position_embeddings,
            dtype=loaded.dtype,
            devices=self.devices,
            limits=pb.Limits(
                max_items=limits.max_items,
                max_labels=limits.max_labels,
                max_text_chars=limits.max_text_chars,
                max_queue_items=self.config.max_queue_items,
                max_sequence_tokens=conv.requests.max_sequence_tokens,
                max_item_tokens=conv.requests.max_item_tokens,
                max_queue_tokens=cfg.max_queue_tokens,
                max_request_tokens=limits.max_request_tokens or 0,
                max_streams=cfg.max_streams,
                max_concurrent_rpcs=cfg.max_concurrent_rpcs,
                stream_idle_timeout_ms=int(cfg.stream_idle_timeout_s * 1000),
                max_pending_batches=cfg.max_pending_batches,
                keepalive_time_ms=int(cfg.keepalive_time_s * 1000),
                keepalive_timeout_ms=int(cfg.keepalive_timeout_s * 1000),
                max_connection_idle_ms=int(cfg.max_connection_idle_s * 1000),
                max_connection_age_ms=int(cfg.max_connection_age_s * 1000),
                max_connection_age_grace_ms=int(cfg.max_connection_age_grace_s * 1000),
                max_message_bytes=cfg.max_message_bytes,
                pool_bytes=self.engine.pool_bytes if self.engine else 0,
            ),
            has_tokenizer=loaded.tokenizer is not None,
            attention=self.engine.attn_impl if self.engine else "",
            version=__version__,
            template=self.template.name if self.template else "",
            call_shapes_ready=self.engine.shapes_ready if self.engine else 0,
            call_shapes=self.call_shapes,
        )


def _client_gone(context: grpc.aio.ServicerContext) -> RpcFailure | None:
    """The status of a call its client ended (deadline passed, cancelled, disconnected), or None
    while the client is still there."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed")
    if context.cancelled() or context.done():
        return RpcFailure(grpc.StatusCode.CANCELLED, "the client went away")
    return None


async def validated(size: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) (validation and tokenization) inline for a request of `size` bytes up to
    INLINE_VALIDATION_BYTES, else in a thread; `size` None (unknown): in a thread."""
    if size is not None and size <= INLINE_VALIDATION_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _settle(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


class _StreamSession:
    """One ScoreStream: a reader task takes client messages (open, then item batches) and
    submits work; the handler writes `opened`, each batch's scores as they complete,
    then the usage once the client half-closed and every batch was answered.

    Bounded (docs/operations.md): at most `max_pending_batches` batches accepted and not yet
    sent back; past that the reader stops reading, so HTTP/2 flow control pushes back on a
    client that sends without reading, and nothing piles up in server memory. A stream that
    neither sends (with nothing in flight) nor reads for `stream_idle_timeout_s` is ended."""

    def __init__(self, server: ScoreServer, context: grpc.aio.ServicerContext) -> None:
        self.server = server
        self.context = context
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.spec: StreamSpec | None = None
        self.pinned: StreamPin | None = None
        self.cached_tokens = 0
        self.item_tokens = 0
        self.items = 0
        self.outstanding: dict[int, WorkUnit] = {}  # id(unit) -> unit
        self.batch_ids: set[int] = set()  # batches accepted and not yet answered
        self.slots = asyncio.Semaphore(server.config.max_pending_batches)
        self.idle_s = server.config.stream_idle_timeout_s
        self.reader: asyncio.Task | None = None

    async def run(self, requests: Any) -> None:
        self.reader = asyncio.ensure_future(self._read(requests))
        eof = False
        while True:
            kind, payload = await self.events.get()
            if kind == "write":
                await self._write(payload)
            elif kind == "answer":  # an empty batch, or one refused
                response, batch_id = payload
                await self._write(response)
                self._answered(batch_id)
            elif kind == "unit":
                unit, batch_id = payload
                self.outstanding.pop(id(unit), None)
                if unit.error is not None:
                    raise _unit_failure(unit.error)
                batch = pb.BatchScores(batch_id=batch_id, scores=item_scores(unit.scores))
                await self._write(pb.ScoreStreamResponse(batch=batch))
                self._answered(batch_id)
            elif kind == "fail":
                raise payload
            elif kind == "eof":
                eof = True
            if eof and not self.outstanding and not self.batch_ids:
                usage = pb.Usage(
                    prompt_tokens=len(self.spec.prefix) + self.item_tokens if self.spec else 0,
                    cached_tokens=self.cached_tokens,
                    items=self.items,
                )
                await self._write(pb.ScoreStreamResponse(usage=usage))
                return

    def _idle(self, what: str) -> RpcFailure:
        self.server.metrics.streams_idle_closed.inc()
        return RpcFailure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"stream: the client {what} for {self.idle_s:g} s (the server's stream idle timeout); stream ended",
        )

    async def _write(self, message: pb.ScoreStreamResponse) -> None:
        """Write, bounded: a client that reads nothing for the idle timeout loses the stream."""
        try:
            await asyncio.wait_for(self.context.write(message), self.idle_s)
        except asyncio.TimeoutError:
            raise self._idle("read no response") from None
        except _CallEnded:
            # gRPC refuses a message on a call that is already over: the client cancelled, went
            # away or its deadline passed while its answer was computed (the context's flags can
            # lag behind). Its choice, not a server error: no ERROR log, no INTERNAL
            gone = _client_gone(self.context) or RpcFailure(grpc.StatusCode.CANCELLED, "the client went away")
            log.debug("stream write dropped: %s", gone.message)
            raise gone from None

    def _answered(self, batch_id: int) -> None:
        self.batch_ids.discard(batch_id)
        self.slots.release()

    async def _next(self, messages: Any) -> bytes | None:
        """The next client message (None at the end), or the idle failure: a stream with nothing
        in flight that sends nothing for the idle timeout. Waiting for answers is not idle."""
        read = asyncio.ensure_future(messages.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=self.idle_s)
                if done:
                    try:
                        return read.result()
                    except StopAsyncIteration:
                        return None
                if not self.batch_ids:
                    raise self._idle("sent nothing")
        finally:
            read.cancel()

    async def _read(self, requests: Any) -> None:
        messages = requests.__aiter__()
        try:
            while (raw := await self._next(messages)) is not None:
                msg = parse(pb.ScoreStreamRequest, raw)
                which = msg.WhichOneof("kind")
                if which == "open":
                    await self._open(msg.open)
                elif which == "batch":
                    if self.slots.locked():
                        self.server.metrics.stream_backpressure.inc()
                    await self.slots.acquire()  # backpressure: no reading past the unsent results
                    await self._batch(msg.batch)
                else:
                    raise InvalidInput("request", "set either open or batch")
            if self.spec is None:
                raise InvalidInput("open", "the stream ended before it was opened; send open first")
            self.events.put_nowait(("eof", None))
        except RpcFailure as failure:
            self.events.put_nowait(("fail", failure))
        except InvalidInput as err:
            self.events.put_nowait(("fail", invalid(err)))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            if self.context.cancelled() or self.context.done():
                # the client went away mid-read: its choice, not a server error (no ERROR log,
                # no INTERNAL inflating the error-ratio alert)
                log.debug("stream reader ended: the client went away (%s)", type(err).__name__)
                self.events.put_nowait(("fail", RpcFailure(grpc.StatusCode.CANCELLED, "the client went away")))
            else:
                self.events.put_nowait(("fail", internal_failure("reading the stream failed", err)))

    async def _open(self, msg: pb.StreamOpen) -> None:
        if self.spec is not None:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION, "open: the stream is already open; send open once, first"
            )
        await echo_prefix_key(_input_key(msg.query))
        converter = self.server._check_accepting()
        spec = await validated(msg.ByteSize(), converter.stream_open, msg)
        if spec.prefix:
            # pin the query's pages (refused at once when the pool cannot hold them) and prefill
            # it now: its KV stays on the device while the stream is open. The pin is recorded
            # before the prefill is awaited, so a stream cancelled during it still unpins (close)
            self.pinned = self.server._pin(spec.prefix)
            try:
                self.cached_tokens = await asyncio.wrap_future(self.pinned.ready)
            except Exception as err:  # WorkerStopped: UNAVAILABLE; a failed prefill: INTERNAL
                raise _unit_failure(err) from err
        self.spec = spec
        opened = pb.StreamOpened(
            prefix_tokens=len(spec.prefix), cached_tokens=self.cached_tokens, label_token_ids=spec.label_ids
        )
        self.events.put_nowait(("write", pb.ScoreStreamResponse(opened=opened)))

    async def _batch(self, msg: pb.ItemBatch) -> None:
        if self.spec is None:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION, "batch: items sent before the stream was opened; send open first"
            )
        batch_id = msg.batch_id
        if batch_id in self.batch_ids:
            # two answers with one id could not be told apart
            raise InvalidInput("batch_id", f"{batch_id} is already in flight on this stream; use a new id per batch")
        assert self.server.converter is not None
        req = await validated(msg.ByteSize(), self.server.converter.stream_batch, self.spec, msg)
        self.batch_ids.add(batch_id)
        if not req.items:
            answer = pb.ScoreStreamResponse(batch=pb.BatchScores(batch_id=batch_id))
            self.events.put_nowait(("answer", (answer, batch_id)))
            return
        unit = self.server._unit(req, "ScoreStream", self.server._deadline(self.context))
        unit.counts_lookup = False  # the open counted this stream's prefix-cache lookup
        unit.on_done = lambda u: self.events.put_nowait(("unit", (u, batch_id)))  # on this loop (_deliver)
        self.outstanding[id(unit)] = unit
        try:
            self.server.worker.submit(unit)
        except QueueFull as full:
            # a full queue refuses this batch only: the stream, the batches it already has in
            # flight and the ones it sends later go on (a stream is long-lived; ending it would
            # throw away accepted work and the query's prefill)
            self.outstanding.pop(id(unit), None)
            refused = pb.BatchRefused(
                batch_id=batch_id,
                code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                message=f"server busy: {full}",
                retry_after_ms=full.retry_after_ms,
            )
            self.events.put_nowait(("answer", (pb.ScoreStreamResponse(refused=refused), batch_id)))
            return
        except WorkerStopped as err:
            self.outstanding.pop(id(unit), None)
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, str(err)) from err
        # usage counts what is scored: a refused batch is not
        self.items += len(req.items)
        self.item_tokens += sum(len(it) for it in req.items) if not self.spec.item_first else req.prompt_tokens

    def close(self) -> None:
        """Cancel queued work of an ended stream and unpin its prefix."""
        if self.reader is not None:
            self.reader.cancel()
        for unit in self.outstanding.values():
            self.server.worker.cancel(unit)
        self.outstanding.clear()
        if self.pinned is not None:
            self.server.worker.release(self.pinned)
            self.pinned = None


class ServerThread:
    """A ScoreServer on its own event loop in a background thread (tests, notebooks).

    with ServerThread(ServerConfig(model="tiny-qwen3", port=0, host="127.0.0.1")) as srv:
        ScoreClient(srv.target).score(...)
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.server: ScoreServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="prefixscore-grpc", daemon=True)

    def _run(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def start(self, wait_ready: bool = True, timeout: float = 600.0) -> ServerThread:
        self._thread.start()

        async def create() -> ScoreServer:
            server = ScoreServer(self.config)
            await server.start()
            return server

        self.server = self._run(create(), timeout)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        assert self.server is not None
        self._run(self.server.wait_ready(), timeout)

    @property
    def target(self) -> str:
        assert self.server is not None
        host = self.config.host if self.config.host not in ("0.0.0.0", "[::]", "") else "127.0.0.1"
        return f"{host}:{self.server.port}"

    def drain(self, timeout: float | None = None) -> None:
        assert self.server is not None
        self._run(self.server.drain(timeout))

    def stop(self) -> None:
        """Stop the server (draining in-flight RPCs briefly) and the loop thread."""
        if self.server is not None and not self.server._stopped.is_set():
            self._run(self.server.drain(5.0))
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
