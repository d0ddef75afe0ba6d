"""The gRPC transport: `prefixscore.v1.ScoreService` on grpc.aio, plus grpc.health.v1.Health
and server reflection, over the service's core (service/core.py).

Handlers parse the message (service/wire.py maps it onto the engine's validation inputs),
validate through the core (inline, or in a thread for a large message), hand the request
to the core's device loop, and map the core's `Failure` onto a status. Every response
carries the request id and the prefix key as initial metadata. Health is NOT_SERVING
until the process (service/process.py) says the core is ready, and again while draining.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixscore import prefix_key
from prefixscore.engine.loop.page_pins import StreamPin
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.requests.embedding import EmbeddingRequests
from prefixscore.engine.requests.templates import ranked
from prefixscore.engine.requests.validation import InvalidInput, StreamSpec
from prefixscore.service import security
from prefixscore.service.core import (
    Failure,
    ScoringService,
    internal_failure,
    invalid,
    unit_failure,
    validated,
)
from prefixscore.service.wire import (
    RequestConverter,
    embed_input,
    embed_response,
    embeddings,
    item_scores,
    parse,
    usage,
)
from prefixscore.telemetry import request_ids
from prefixscore.v1 import score_service_pb2 as pb

log = logging.getLogger("prefixscore.server")

try:  # what grpc.aio raises when a message is written on a call that has already ended
    from grpc._cython.cygrpc import ExecuteBatchError as _CallEnded
except ImportError:  # pragma: no cover (another grpcio layout: such writes count as INTERNAL)
    _CallEnded = type("_CallEnded", (Exception,), {})

SERVICE = pb.DESCRIPTOR.services_by_name["ScoreService"].full_name  # "prefixscore.v1.ScoreService"
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal: when to retry


def _trailers(failure: Failure) -> tuple[tuple[str, str], ...]:
    return ((RETRY_AFTER_KEY, str(failure.retry_after_ms)),) if failure.retry_after_ms is not None else ()


class _InitialMetadata:
    """An RPC's initial metadata: its request id, and its prefix key once the request is parsed
    (prefix_key.py). Sent once, before the first response or the status: a stream
    sends it at its open, as soon as it knows the key; a unary call's goes with its answer or
    its status (the wrapper), so that the call has no headers while it runs (retryable)."""

    def __init__(self, context: grpc.aio.ServicerContext, rid: str) -> None:
        self.context = context
        self.rid = rid
        self.key: str | None = None
        self.sent = False

    async def send(self, key: str | None = None) -> None:
        if self.sent:
            return
        self.sent = True
        key = key or self.key
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


def answer_with_prefix_key(key: str) -> None:
    """A unary RPC's prefix key, echoed in the initial metadata sent with its answer, not now:
    until a call has response headers, a proxy (Envoy's retry_on reset) and the client's retry
    policy may send it to another replica, so a replica killed under it loses no request."""
    _ECHO.get().key = key


def _input_key(query: pb.Input) -> str:
    return prefix_key.for_score(query.text if query.WhichOneof("kind") == "text" else query.token_ids.ids)


def _rpc(method: str) -> Callable:
    """Wrap a handler: metrics (requests by code, latency, in-flight) and error -> status mapping."""

    def decorate(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def handler(self: GrpcServer, request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._observe(method, fn, request, context)

        return handler

    return decorate


class GrpcServer:
    """The ScoreService and health servers on one port, over `service`; see the module doc.
    Use from one asyncio event loop."""

    def __init__(self, service: ScoringService) -> None:
        self.service = service
        self.config = service.config
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.streams = 0  # ScoreStreams open now
        self._converter: RequestConverter | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self, tokens: security.TokenFile | None) -> int:
        """Listen now, health NOT_SERVING; returns the bound port."""
        cfg = self.config
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
                        "Embed": grpc.unary_unary_rpc_method_handler(
                            self.embed, response_serializer=pb.EmbedResponse.SerializeToString, **raw
                        ),
                        "EmbedStream": grpc.stream_stream_rpc_method_handler(
                            self.embed_stream, response_serializer=pb.EmbedStreamResponse.SerializeToString, **raw
                        ),
                    },
                ),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if cfg.reflection:
            reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self.set_serving(False)
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
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def enter_graceful_shutdown(self) -> None:
        """Health NOT_SERVING for good: load balancers move traffic away while calls finish."""
        await self.health.enter_graceful_shutdown()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)

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
        with self.service.accounted(method) as outcome:
            try:
                response = await fn(self, request, context)
                await echo.send()
                return response
            except Failure as failure:
                outcome.status = failure.code.name
                trailers = _trailers(failure)
                if failure.code == grpc.StatusCode.UNAVAILABLE and not echo.sent:
                    # no headers, the request id in the trailers (a Trailers-Only answer): a
                    # client's retry policy sends the call to another replica only then, gRPC
                    # commits a call at its first response headers (gRFC A6)
                    trailers += ((request_ids.HEADER, echo.rid),)
                else:
                    await echo.send()
                await context.abort(failure.code, failure.message, trailing_metadata=trailers)
            except InvalidInput as err:
                failure = invalid(err)
                outcome.status = failure.code.name
                await echo.send()
                await context.abort(failure.code, failure.message)
            except asyncio.CancelledError:
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= 0
                outcome.status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
                raise
            except Exception as err:
                outcome.status = "INTERNAL"
                await echo.send()
                await context.abort(grpc.StatusCode.INTERNAL, internal_failure(f"{method} failed", err).message)

    def _accepting(self) -> RequestConverter:
        """The wire converter over the core's validator (UNAVAILABLE while loading or draining)."""
        validator = self.service.accepting()
        if self._converter is None or self._converter.validator is not validator:
            self._converter = RequestConverter(validator)
        return self._converter

    @staticmethod
    def _deadline(context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    # ---- Score -----------------------------------------------------------------------------------
    @_rpc("Score")
    async def score(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        msg = parse(pb.ScoreRequest, raw)
        converter = self._accepting()  # before any headers: refused UNAVAILABLE, the call stays retryable
        answer_with_prefix_key(_input_key(msg.query))
        checked = await validated(len(raw), converter.score_request, msg)
        req = checked.request
        differs = checked.joined_differs or []
        # the head it was validated for: a classifier's columns are its labels, named; a causal
        # LM's are the label tokens
        head = converter.validator.requests.head
        names, label_ids = head.label_names, head.label_token_ids(req.label_ids)
        if not req.items:
            return pb.ScoreResponse(usage=pb.Usage(), label_token_ids=label_ids, label_names=names)
        unit = await self.service.run(req, "Score", self._deadline(context))
        return pb.ScoreResponse(
            scores=item_scores(req, unit.reply),
            usage=usage(req, unit.reply.cached_tokens, checked.truncation),
            label_token_ids=label_ids,
            joined_tokenization_differs=differs,
            label_names=names,
        )

    # ---- Rerank ----------------------------------------------------------------------------------
    @_rpc("Rerank")
    async def rerank(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        msg = parse(pb.RerankRequest, raw)
        converter = self._accepting()  # before any headers, as in Score
        answer_with_prefix_key(prefix_key.for_rerank(msg.query, msg.instruction))
        checked = await validated(len(raw), converter.rerank_request, msg)
        req = checked.scored.request
        template = self.service.template.name if self.service.template else ""
        if not req.items:
            return pb.RerankResponse(usage=pb.Usage(), template=template)
        unit = await self.service.run(req, "Rerank", self._deadline(context))
        differs = checked.scored.joined_differs
        results = [
            pb.RerankResult(
                index=r.index,
                relevance_score=r.relevance_score,
                document=checked.documents[r.index] if msg.return_documents else "",
                joined_tokenization_differs=bool(differs and differs[r.index]),
            )
            for r in ranked(unit.reply.answer, checked.top_n)
        ]
        return pb.RerankResponse(
            results=results, usage=usage(req, unit.reply.cached_tokens, checked.scored.truncation), template=template
        )

    # ---- Embed -----------------------------------------------------------------------------------
    @_rpc("Embed")
    async def embed(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        msg = parse(pb.EmbedRequest, raw)
        embeddings = self.service.accepting_embeddings()  # before any headers, as in Score
        checked = await validated(len(raw), embeddings.validate, embed_input(msg))
        unit = await self.service.run(checked.request, "Embed", self._deadline(context))
        return embed_response(checked, checked.finish(unit.reply.answer), unit.reply.cached_tokens)

    # ---- ScoreStream and EmbedStream --------------------------------------------------------------
    @_rpc("ScoreStream")
    async def score_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await self._stream(_StreamSession(self, context), requests)

    @_rpc("EmbedStream")
    async def embed_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await self._stream(_EmbedSession(self, context), requests)

    async def _stream(self, session: _StreamSession, requests: Any) -> None:
        """Run a stream session; both kinds count against one limit of open streams."""
        self._accepting()
        if self.streams >= self.config.max_streams:
            self.service.metrics.rejected.inc()
            raise Failure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server busy: {self.streams} streams are open (limit {self.config.max_streams}); retry later",
                retry_after_ms=1000,
            )
        self.streams += 1
        self.service.metrics.open_streams.inc()
        try:
            await session.run(requests)
        finally:
            self.streams -= 1
            self.service.metrics.open_streams.dec()
            session.close()

    # ---- GetModelInfo ----------------------------------------------------------------------------
    @_rpc("GetModelInfo")
    async def get_model_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        parse(pb.GetModelInfoRequest, raw)
        validator = self.service.accepting()  # draining: UNAVAILABLE like every call, so clients go elsewhere
        service = self.service
        served = service.served
        assert served is not None
        cfg = self.config
        limits, requests = validator.requests.limits, validator.requests
        return pb.GetModelInfoResponse(
            model=served.name,
            family=served.family,
            vocab_size=served.vocab_size,
            context_length=served.context_length,
            sliding_window=served.sliding_window or 0,
            max_position_embeddings=served.max_position_embeddings,
            tp_size=served.tp_size,
            dp_size=served.dp_size,
            dtype=served.dtype,
            devices=served.devices,
            limits=pb.Limits(
                max_items=limits.max_items,
                max_labels=limits.max_labels,
                max_text_chars=limits.max_text_chars,
                max_queue_items=cfg.max_queue_items,
                max_sequence_tokens=requests.max_sequence_tokens,
                max_item_tokens=requests.max_item_tokens,
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
                pool_bytes=served.pool_bytes,
            ),
            has_tokenizer=served.has_tokenizer,
            attention=served.attention,
            version=served.version,
            template=served.template or "",
            template_reason=served.template_reason,
            # how many call shapes are compiled changes while a staged warm-up runs: read it now
            call_shapes_ready=service.engine.shapes_ready if service.engine else 0,
            call_shapes=service.call_shapes,
            head=served.head,
            label_names=served.label_names,
            quantization=served.quantization,
            activation_quantization=served.activation_quantization,
            quantized_projections=served.quantized_projections,
            weight_bytes_per_device=served.weight_bytes_per_device,
            pooling=served.pooling or "",
            embedding_dimensions=served.embedding_dimensions or 0,
            prompt_names=served.prompt_names,
        )


def _scores(unit: WorkUnit, batch_id: int) -> pb.ScoreStreamResponse:
    """A ScoreStream batch's answer: its items' scores."""
    return pb.ScoreStreamResponse(batch=pb.BatchScores(batch_id=batch_id, scores=item_scores(unit.payload, unit.reply)))


def _client_gone(context: grpc.aio.ServicerContext) -> Failure | None:
    """The status of a call its client ended (deadline passed, cancelled, disconnected), or None
    while the client is still there."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed")
    if context.cancelled() or context.done():
        return Failure(grpc.StatusCode.CANCELLED, "the client went away")
    return None


# what the stream's handler is told, in order, by its reader task and the device loop
_StreamResponse = pb.ScoreStreamResponse | pb.EmbedStreamResponse


@dataclasses.dataclass(frozen=True)
class _Write:
    message: _StreamResponse  # to send as is (`opened`)


@dataclasses.dataclass(frozen=True)
class _Answer:
    message: _StreamResponse  # a batch's answer without device work: empty, or refused
    batch_id: int


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A stream's batch, validated: its request, what usage counts for it, and its answer."""

    request: TokenizedRequest
    prompt_tokens: int
    answer: Callable[[WorkUnit, int], _StreamResponse]  # (its finished unit, batch id) -> the answer


@dataclasses.dataclass(frozen=True)
class _Scored:
    unit: WorkUnit  # a batch the device loop finished (its answer, or its error)
    batch: _Batch
    batch_id: int


@dataclasses.dataclass(frozen=True)
class _Ended:
    failure: Failure | None = None  # None: the client half-closed; else what ends the stream


_StreamEvent = _Write | _Answer | _Scored | _Ended


class _StreamSession:
    """One stream (ScoreStream; EmbedStream below): a reader task takes client messages (open,
    then item batches) and submits work; the handler writes `opened`, each batch's answer as it
    completes, then the usage once the client half-closed and every batch was answered. What
    differs by kind: the messages, what the open pins, and a batch's validation and answer.

    Bounded (docs/operations.md): at most `max_pending_batches` batches accepted and not yet
    sent back; past that the reader stops reading, so HTTP/2 flow control pushes back on a
    client that sends without reading, and nothing piles up in server memory. A stream that
    neither sends (with nothing in flight) nor reads for `stream_idle_timeout_s` is ended."""

    method = "ScoreStream"
    request_type: type[pb.ScoreStreamRequest | pb.EmbedStreamRequest] = pb.ScoreStreamRequest
    response_type: type[_StreamResponse] = pb.ScoreStreamResponse

    def __init__(self, server: GrpcServer, context: grpc.aio.ServicerContext) -> None:
        self.server = server
        self.service = server.service
        self.context = context
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[_StreamEvent] = asyncio.Queue()
        self.opened = False
        self.spec: StreamSpec | None = None
        self.converter: RequestConverter | None = None  # set by the open
        self.pinned: StreamPin | None = None
        self.cached_tokens = 0
        self.prompt_tokens = 0  # usage: the prefix once, then what each batch adds
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
            happened = await self.events.get()
            if isinstance(happened, _Write):
                await self._write(happened.message)
            elif isinstance(happened, _Answer):  # an empty batch, or one refused
                await self._write(happened.message)
                self._answered(happened.batch_id)
            elif isinstance(happened, _Scored):
                unit = happened.unit
                self.outstanding.pop(id(unit), None)
                if unit.reply.error is not None:
                    raise unit_failure(unit.reply.error)
                await self._write(happened.batch.answer(unit, happened.batch_id))
                self._answered(happened.batch_id)
            elif isinstance(happened, _Ended):
                if happened.failure is not None:
                    raise happened.failure
                eof = True
            if eof and not self.outstanding and not self.batch_ids:
                usage = pb.Usage(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, items=self.items)
                await self._write(self.response_type(usage=usage))
                return

    def _idle(self, what: str) -> Failure:
        self.service.metrics.streams_idle_closed.inc()
        return Failure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"stream: the client {what} for {self.idle_s:g} s (the server's stream idle timeout); stream ended",
        )

    async def _write(self, message: _StreamResponse) -> None:
        """Write, bounded: a client that reads nothing for the idle timeout loses the stream."""
        try:
            await asyncio.wait_for(self.context.write(message), self.idle_s)
        except asyncio.TimeoutError:
            raise self._idle("read no response") from None
        except _CallEnded:
            # gRPC refuses a message on a call that is already over: the client cancelled, went
            # away or its deadline passed while its answer was computed (the context's flags can
            # lag behind). Its choice, not a server error: no ERROR log, no INTERNAL
            gone = _client_gone(self.context) or Failure(grpc.StatusCode.CANCELLED, "the client went away")
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
                msg = parse(self.request_type, raw)
                which = msg.WhichOneof("kind")
                if which == "open":
                    await self._open(msg.open)
                elif which == "batch":
                    if self.slots.locked():
                        self.service.metrics.stream_backpressure.inc()
                    await self.slots.acquire()  # backpressure: no reading past the unsent results
                    await self._batch(msg.batch)
                else:
                    raise InvalidInput("request", "set either open or batch")
            if not self.opened:
                raise InvalidInput("open", "the stream ended before it was opened; send open first")
            self.events.put_nowait(_Ended())
        except Failure as failure:
            self.events.put_nowait(_Ended(failure))
        except InvalidInput as err:
            self.events.put_nowait(_Ended(invalid(err)))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            if self.context.cancelled() or self.context.done():
                # the client went away mid-read: its choice, not a server error (no ERROR log,
                # no INTERNAL inflating the error-ratio alert)
                log.debug("stream reader ended: the client went away (%s)", type(err).__name__)
                self.events.put_nowait(_Ended(Failure(grpc.StatusCode.CANCELLED, "the client went away")))
            else:
                self.events.put_nowait(_Ended(internal_failure("reading the stream failed", err)))

    async def _open(self, msg: Any) -> None:
        if self.opened:
            raise Failure(
                grpc.StatusCode.FAILED_PRECONDITION, "open: the stream is already open; send open once, first"
            )
        prefix, opened = await self._opening(msg)
        if prefix:
            # pin the prefix's pages (refused at once when the pool cannot hold them) and prefill
            # it now: its KV stays on the device while the stream is open. The pin is recorded
            # before the prefill is awaited, so a stream cancelled during it still unpins (close)
            self.pinned = self.service.pin(prefix)
            try:
                self.cached_tokens = await asyncio.wrap_future(self.pinned.ready)
            except Exception as err:  # WorkerStopped: UNAVAILABLE; a failed prefill: INTERNAL
                raise unit_failure(err) from err
        self.opened = True
        self.events.put_nowait(_Write(self.response_type(opened=opened(len(prefix), self.cached_tokens))))

    async def _opening(self, msg: pb.StreamOpen) -> tuple[tuple[int, ...], Callable[[int, int], Any]]:
        """The open validated: the prefix to pin, and its `opened` answer from (prefix tokens,
        cached tokens). A ScoreStream's prefix is its query."""
        await echo_prefix_key(_input_key(msg.query))
        self.converter = self.server._accepting()
        spec = await validated(msg.ByteSize(), self.converter.stream_open, msg)
        self.spec = spec
        self.prompt_tokens = len(spec.prefix)
        label_ids = self.converter.validator.requests.head.label_token_ids(spec.label_ids)
        return spec.prefix, lambda prefix, cached: pb.StreamOpened(
            prefix_tokens=prefix, cached_tokens=cached, label_token_ids=label_ids
        )

    async def _checked(self, msg: pb.ItemBatch) -> _Batch:
        """A batch of the open stream, validated (its items over the stream's query)."""
        # the converter of the open: an open stream is served to its end, draining or not
        assert self.converter is not None and self.spec is not None
        spec = self.spec
        req = await validated(msg.ByteSize(), self.converter.stream_batch, spec, msg)
        tokens = sum(len(it) for it in req.items) if not spec.item_first else req.prompt_tokens
        return _Batch(req, tokens, _scores)

    async def _batch(self, msg: pb.ItemBatch) -> None:
        if not self.opened:
            raise Failure(
                grpc.StatusCode.FAILED_PRECONDITION, "batch: items sent before the stream was opened; send open first"
            )
        batch_id = msg.batch_id
        if batch_id in self.batch_ids:
            # two answers with one id could not be told apart
            raise InvalidInput("batch_id", f"{batch_id} is already in flight on this stream; use a new id per batch")
        batch = await self._checked(msg) if msg.items else None
        self.batch_ids.add(batch_id)
        if batch is None:
            self.events.put_nowait(_Answer(self.response_type(batch={"batch_id": batch_id}), batch_id))
            return
        # the open counted this stream's prefix-cache lookup
        unit = self.service.unit(batch.request, self.method, self.server._deadline(self.context), counts_lookup=False)
        unit.reply.on_done = lambda u: self.events.put_nowait(_Scored(u, batch, batch_id))  # on this loop (_deliver)
        self.outstanding[id(unit)] = unit
        try:
            self.service.submit(unit)
        except Failure as failure:
            self.outstanding.pop(id(unit), None)
            if failure.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            # a full queue refuses this batch only: the stream, the batches it already has in
            # flight and the ones it sends later go on (a stream is long-lived; ending it would
            # throw away accepted work and the prefix's prefill)
            refused = pb.BatchRefused(
                batch_id=batch_id,
                code=failure.code.value[0],
                message=failure.message,
                retry_after_ms=failure.retry_after_ms or 0,
            )
            self.events.put_nowait(_Answer(self.response_type(refused=refused), batch_id))
            return
        # usage counts what is computed: a refused batch is not
        self.items += len(batch.request.items)
        self.prompt_tokens += batch.prompt_tokens

    def close(self) -> None:
        """Cancel queued work of an ended stream and unpin its prefix."""
        if self.reader is not None:
            self.reader.cancel()
        for unit in self.outstanding.values():
            self.service.cancel(unit)
        self.outstanding.clear()
        if self.pinned is not None:
            self.service.release(self.pinned)
            self.pinned = None


class _EmbedSession(_StreamSession):
    """One EmbedStream: the open's prompt (its shared run, engine/requests/embedding.py) pinned, each
    batch's inputs embedded over it as Embed embeds a request's."""

    method = "EmbedStream"
    request_type = pb.EmbedStreamRequest
    response_type = pb.EmbedStreamResponse

    def __init__(self, server: GrpcServer, context: grpc.aio.ServicerContext) -> None:
        super().__init__(server, context)
        self.embedding: EmbeddingRequests | None = None  # the validation of the open, for its batches
        self.open_msg = pb.EmbedStreamOpen()

    async def _opening(self, msg: pb.EmbedStreamOpen) -> tuple[tuple[int, ...], Callable[[int, int], Any]]:
        await echo_prefix_key(prefix_key.for_embed(msg.prompt_name if msg.HasField("prompt_name") else None))
        self.embedding = self.service.accepting_embeddings()
        self.open_msg = msg
        prompt = await validated(msg.ByteSize(), self.embedding.stream_open, embed_input(msg))
        return prompt.prefix, lambda prefix, cached: pb.EmbedStreamOpened(
            prefix_tokens=prefix, cached_tokens=cached, dimensions=prompt.dimensions
        )

    async def _checked(self, msg: pb.ItemBatch) -> _Batch:
        assert self.embedding is not None  # an open stream is served to its end, draining or not
        checked = await validated(msg.ByteSize(), self.embedding.validate, embed_input(self.open_msg, msg.items))

        def answer(unit: WorkUnit, batch_id: int) -> pb.EmbedStreamResponse:
            vectors = checked.finish(unit.reply.answer)
            return pb.EmbedStreamResponse(
                batch=pb.BatchEmbeddings(
                    batch_id=batch_id, embeddings=embeddings(vectors), truncated_items=checked.truncated
                )
            )

        return _Batch(checked.request, checked.prompt_tokens, answer)
