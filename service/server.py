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
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixscore import prefix_key
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import input_of, plain
from prefixscore.service import security
from prefixscore.service.core import ScoringService
from prefixscore.service.failures import Failure, internal_failure, invalid
from prefixscore.service.grpc_metadata import ECHO, InitialMetadata, answer_with_prefix_key, deadline_of, input_key
from prefixscore.service.grpc_streams import EmbedSession, StreamSession
from prefixscore.service.wire import (
    embed_input,
    embed_response,
    item_scores,
    parse,
    rerank_input,
    score_input,
    score_kind,
    usage,
)
from prefixscore.telemetry import request_ids
from prefixscore.v1 import score_service_pb2 as pb

log = logging.getLogger("prefixscore.server")

SERVICE = pb.DESCRIPTOR.services_by_name["ScoreService"].full_name  # "prefixscore.v1.ScoreService"
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal: when to retry


def _trailers(failure: Failure) -> tuple[tuple[str, str], ...]:
    return ((RETRY_AFTER_KEY, str(failure.retry_after_ms)),) if failure.retry_after_ms is not None else ()


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
                        "Run": grpc.unary_unary_rpc_method_handler(
                            self.run, response_serializer=pb.RunResponse.SerializeToString, **raw
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
            echo = InitialMetadata(context, rid)
            token = ECHO.set(echo)
            try:
                return await self._observe_bound(method, fn, request, context, echo)
            finally:
                ECHO.reset(token)

    async def _observe_bound(
        self, method: str, fn: Callable, request: Any, context: grpc.aio.ServicerContext, echo: InitialMetadata
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

    # ---- Score -----------------------------------------------------------------------------------
    @_rpc("Score")
    async def score(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        msg = parse(pb.ScoreRequest, raw)
        kinds = self.service.accepting()  # before any headers: refused UNAVAILABLE, the call stays retryable
        answer_with_prefix_key(input_key(msg.query))
        inp = score_input(msg)
        answer = await self.service.serve(kinds[score_kind(inp)], inp, "Score", len(raw), deadline_of(context))
        req = answer.plan.request
        # the head it was validated for: a classifier's columns are its labels, named; a causal
        # LM's are the label tokens
        head = kinds.requests.head
        return pb.ScoreResponse(
            scores=item_scores(req, answer.result),
            usage=usage(req, answer.cached_tokens, answer.plan.truncation) if req.items else pb.Usage(),
            label_token_ids=head.label_token_ids(req.label_ids),
            joined_tokenization_differs=answer.plan.joined_differs or [],
            label_names=head.label_names,
        )

    # ---- Rerank ----------------------------------------------------------------------------------
    @_rpc("Rerank")
    async def rerank(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        msg = parse(pb.RerankRequest, raw)
        kinds = self.service.accepting()  # before any headers, as in Score
        answer_with_prefix_key(prefix_key.for_rerank(msg.query, msg.instruction))
        answer = await self.service.serve(kinds["rerank"], rerank_input(msg), "Rerank", len(raw), deadline_of(context))
        checked = answer.plan
        req = checked.scored.request
        template = self.service.template.name if self.service.template else ""
        if not req.items:
            return pb.RerankResponse(usage=pb.Usage(), template=template)
        differs = checked.scored.joined_differs
        results = [
            pb.RerankResult(
                index=r.index,
                relevance_score=r.relevance_score,
                document=checked.documents[r.index] if msg.return_documents else "",
                joined_tokenization_differs=bool(differs and differs[r.index]),
            )
            for r in answer.result
        ]
        return pb.RerankResponse(
            results=results, usage=usage(req, answer.cached_tokens, checked.scored.truncation), template=template
        )

    # ---- Embed -----------------------------------------------------------------------------------
    @_rpc("Embed")
    async def embed(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        msg = parse(pb.EmbedRequest, raw)
        kinds = self.service.accepting()  # before any headers, as in Score
        answer = await self.service.serve(kinds["embed"], embed_input(msg), "Embed", len(raw), deadline_of(context))
        return embed_response(answer.plan, answer.result, answer.cached_tokens)

    # ---- Run: any kind, its input and result as JSON ---------------------------------------------
    @_rpc("Run")
    async def run(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.RunResponse:
        msg = parse(pb.RunRequest, raw)
        kind = self.service.accepting()[msg.kind]  # before any headers, as in Score
        try:
            fields = json.loads(msg.input or "{}")
        except ValueError as err:
            raise InvalidInput("input", f"is not JSON: {err}") from err
        answer = await self.service.serve(kind, input_of(kind, fields), "Run", len(raw), deadline_of(context))
        return pb.RunResponse(result=json.dumps(plain(answer.result)), usage=pb.Usage(**answer.usage()))

    # ---- ScoreStream and EmbedStream --------------------------------------------------------------
    @_rpc("ScoreStream")
    async def score_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await self._stream(StreamSession(self.service, context), requests)

    @_rpc("EmbedStream")
    async def embed_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await self._stream(EmbedSession(self.service, context), requests)

    async def _stream(self, session: StreamSession, requests: Any) -> None:
        """Run a stream session; both kinds count against one limit of open streams."""
        self.service.accepting()
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
        # the served model's one description (service/served_model.py): the fields the message
        # has, `name` as `model`; proto3 has no null, so a None field stays at its zero ("", 0)
        described = served.describe({"name": "model"}, only=pb.GetModelInfoResponse.DESCRIPTOR.fields_by_name)
        return pb.GetModelInfoResponse(
            **{name: value for name, value in described.items() if value is not None},
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
            # how many call shapes are compiled changes while a staged warm-up runs: read it now
            call_shapes_ready=service.engine.shapes_ready if service.engine else 0,
            call_shapes=service.call_shapes,
        )
