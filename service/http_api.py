"""The HTTP API: SGLang's `/v1/score`, a Cohere/Jina/vLLM-style `/v1/rerank`, vLLM's and SGLang's
`/v1/classify`, OpenAI's `/v1/completions` as scorers call it (echo and logprobs) and its
`/v1/embeddings` (a sentence-transformers checkpoint's pooling, engine/requests/embedding.py), Text
Embeddings Inference's `/embed`, vLLM's
`/tokenize`, `/detokenize` and `/tokenizer_info`, `/v1/models`,
`/health`, `/ready` and `/openapi.json`, served by FastAPI on uvicorn in the process's
event loop (the gRPC server's too), on its own port.

Routes only map JSON onto the transport-neutral inputs of `engine/requests/validation.py` (the one
validation pass gRPC shares) and hand the validated request to the core's `run` (service/core.py), the same
device loop and batcher as gRPC: items of HTTP and gRPC requests over one query ride in
the same device calls. Errors keep SGLang's shape,
`{"object": "error", "message", "type", "param", "code"}`, with `message` starting with
the field at fault: 400 bad input, 413 over a size limit, 429 queue full (Retry-After),
503 loading or draining, 504 deadline, 500 internal.

Every response carries `x-request-id` (the client's when well formed, else a new one),
which is also bound to every log line written while the request is handled.

This module is the app and its routes; beside it: the JSON bodies (http_schemas.py), a body
as a validated input and scores as a response body (http_bodies.py), the error responses
(http_errors.py), the middlewares (http_middleware.py) and the server (http_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.exceptions import HTTPException

from prefixscore import prefix_key
from prefixscore.engine.requests import completions
from prefixscore.engine.requests.embedding import EmbedInput, ValidatedEmbed
from prefixscore.engine.requests.known_positions import KnownPositions
from prefixscore.engine.requests.likelihood import read_likelihoods
from prefixscore.engine.requests.validation import InvalidInput
from prefixscore.service.core import Failure, ScoringService, internal_failure, validated
from prefixscore.service.http_bodies import (
    classify_input,
    classify_response,
    embed_input,
    embed_response,
    rerank_input,
    rerank_response,
    score_input,
    score_response,
    tei_embed_input,
)
from prefixscore.service.http_completions import completions_input, completions_response
from prefixscore.service.http_errors import bad_body, error, invalid, refused
from prefixscore.service.http_middleware import BearerTokens, BodyLimit, RequestIds
from prefixscore.service.http_schemas import (
    ERRORS,
    ClassifyRequest,
    ClassifyResponse,
    CompletionsRequest,
    CompletionsResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbedRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoringRequest,
    ScoringResponse,
    Status,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from prefixscore.service.security import TokenFile
from prefixscore.telemetry import request_ids
from prefixscore.telemetry.logs import event

log = logging.getLogger("prefixscore.http")

# a /v1/completions answer over up to this many prompt tokens is written on the event loop; a
# longer one (a dict of top log-probs a position) in a thread, so the loop serves others meanwhile
INLINE_ANSWER_TOKENS = 2048


def _body_bytes(request: Request) -> int | None:
    """The body's size from Content-Length (None when the client streamed it chunked)."""
    length = request.headers.get("content-length")
    return int(length) if length and length.isdigit() else None


def _encoded(body: BaseModel, key: str | None = None) -> Response:
    """A response model encoded once, by pydantic's own JSON encoder. Returned as a model, FastAPI
    would validate it again against the route's `response_model` (which stays, for the OpenAPI
    document) and encode it in a second pass: host time on every request."""
    return _json(body.model_dump_json(exclude_none=True), key)


def _json(encoded: str | bytes, key: str | None = None) -> Response:
    """An encoded JSON body; `key`: the request's prefix key, echoed as a header
    (prefix_key.py)."""
    headers = {prefix_key.HEADER: key} if key else None
    return Response(encoded, media_type="application/json", headers=headers)


def _label_names(service: ScoringService) -> tuple[str, ...]:
    """The served classifier's label names (none for a causal LM, or before a model is loaded)."""
    return service.loaded.cfg.label_names if service.loaded else ()


def build_app(service: ScoringService, tokens: TokenFile | None = None) -> FastAPI:
    """The FastAPI application over the service's core (its validation and device loop)."""
    from prefixscore.version import __version__

    app = FastAPI(
        title="prefixscore",
        version=__version__,
        description="Score items against a query (SGLang /v1/score) and rerank documents (Cohere/Jina shape) "
        "with a decoder LLM over a shared, cached prefix.",
        # FastAPI's OpenTelemetry bridge asks for the global providers on every request even when
        # none is configured (6% of the event loop's time under small reranks); the service's
        # observability is its Prometheus metrics and request-id logs
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.add_middleware(BodyLimit, limit=service.config.max_message_bytes)
    if tokens is not None:  # outside the body limit: a refused client's body is never read
        app.add_middleware(BearerTokens, tokens=tokens)
    app.add_middleware(RequestIds)  # added last: outermost, so refusals carry the request id too

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_body(exc)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else "HTTPError")

    # /v1/completions: prompts' computed positions, for later prompts that start alike
    known = KnownPositions()

    def model_name(requested: str | None) -> str:
        return requested or (service.loaded.name if service.loaded else "")

    @contextlib.contextmanager
    def handled(method: str) -> Iterator[dict]:
        """Count the request like an RPC (drain waits for it) and turn errors into responses."""
        outcome: dict[str, Any] = {}
        started = time.monotonic()
        with service.accounted(method) as counted:
            try:
                yield outcome
            except InvalidInput as err:
                counted.status = "INVALID_ARGUMENT"
                outcome["response"] = invalid(err)
            except Failure as failure:
                counted.status = failure.code.name
                outcome["response"] = refused(failure)
            except Exception as err:  # what failed and a request id; the details only in the log
                counted.status = "INTERNAL"
                failure = internal_failure(f"{method} failed", err)
                outcome["response"] = error(500, failure.message, "InternalServerError")
            finally:
                # an access-log line; it carries the request id like every line logged while handling it
                seconds = round(time.monotonic() - started, 6)
                event(log, "http_request", logging.DEBUG, method=method, status=counted.status, seconds=seconds)

    @app.post(
        "/v1/score",
        response_model=ScoringResponse,
        response_model_exclude_none=True,
        responses=ERRORS,
        summary="Score items against a query (SGLang /v1/score)",
    )
    async def score(body: ScoringRequest, request: Request) -> Any:
        with handled("HttpScore") as outcome:
            inp = score_input(body)
            checked = await validated(_body_bytes(request), service.accepting().score, inp)
            req = checked.request
            unit = await service.run(req, "HttpScore") if req.items else None
            scores, cached = (unit.reply.answer, unit.reply.cached_tokens) if unit else (None, 0)
            key = prefix_key.for_score(body.query) if body.query is not None else None
            return _encoded(score_response(checked, scores, cached, model_name(body.model), _label_names(service)), key)
        return outcome["response"]

    async def embedded(inp: EmbedInput, size: int | None) -> tuple[ValidatedEmbed, np.ndarray, int]:
        """An embedding request validated, run, and finished: (the request, its embeddings, its
        tokens read from the prefix cache)."""
        checked = await validated(size, service.accepting_embeddings().validate, inp)
        unit = await service.run(checked.request, "HttpEmbed")
        return checked, checked.finish(unit.reply.answer), unit.reply.cached_tokens

    @app.post(
        "/v1/embeddings",
        response_model=EmbeddingResponse,
        responses=ERRORS,
        summary="Embed inputs (OpenAI /v1/embeddings), pooled as the checkpoint's sentence-transformers modules say",
    )
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        with handled("HttpEmbed") as outcome:
            inp = embed_input(body)
            checked, vectors, cached = await embedded(inp, _body_bytes(request))
            response = embed_response(checked, vectors, cached, model_name(body.model), body.encoding_format)
            return _encoded(response, prefix_key.for_embed(inp.prompt_name))
        return outcome["response"]

    @app.post(
        "/embed",
        response_model=list[list[float]],
        responses=ERRORS,
        summary="Embed inputs (Text Embeddings Inference's /embed): one list of floats per input",
    )
    async def tei_embed(body: EmbedRequest, request: Request) -> Any:
        with handled("HttpEmbed") as outcome:
            inp = tei_embed_input(body)
            _, vectors, _ = await embedded(inp, _body_bytes(request))
            return _json(to_json(vectors.tolist()), prefix_key.for_embed(inp.prompt_name))
        return outcome["response"]

    @app.post(
        "/v1/classify",
        response_model=ClassifyResponse,
        responses=ERRORS,
        summary="Classify inputs (vLLM / SGLang /v1/classify): a classifier's head, or a causal LM's label tokens",
    )
    async def classify(body: ClassifyRequest, request: Request) -> Any:
        with handled("HttpClassify") as outcome:
            inp = classify_input(body, service.config.classify_labels)
            checked = await validated(_body_bytes(request), service.accepting().classify, inp)
            unit = await service.run(checked.request, "HttpClassify")
            rid = request_ids.current() or request_ids.new_id()
            reply = unit.reply
            return _encoded(classify_response(checked, reply.answer, reply.cached_tokens, model_name(body.model), rid))
        return outcome["response"]

    async def rerank(body: RerankRequest, request: Request) -> Any:
        with handled("HttpRerank") as outcome:
            inp = rerank_input(body)
            checked = await validated(_body_bytes(request), service.accepting().rerank, inp)
            req = checked.scored.request
            unit = await service.run(req, "HttpRerank") if req.items else None
            scores, cached = (unit.reply.answer, unit.reply.cached_tokens) if unit else (None, 0)
            rid = request_ids.current() or request_ids.new_id()
            response = rerank_response(body, checked, scores, cached, model_name(body.model), rid)
            return _json(to_json(response), prefix_key.for_rerank(body.query, body.instruction))
        return outcome["response"]

    summary = "Rerank documents by relevance to a query (Cohere / Jina / vLLM shape)"
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        app.add_api_route(
            path,
            rerank,
            methods=["POST"],
            response_model=RerankResponse,
            response_model_exclude_none=True,
            responses=ERRORS,
            summary=summary,
            include_in_schema=path == "/v1/rerank",  # one documented path; the others are aliases
        )

    @app.post(
        "/v1/completions",
        response_model=CompletionsResponse,
        response_model_exclude_none=True,
        responses=ERRORS,
        summary="Log-probs of whole prompts and their greedy next token (OpenAI /v1/completions with echo, "
        "logprobs and max_tokens 0 or 1)",
    )
    async def complete(body: CompletionsRequest, request: Request) -> Any:
        with handled("HttpCompletions") as outcome:
            requests = service.accepting().requests
            inp = completions_input(body)
            planned = await validated(_body_bytes(request), completions.plan, requests, inp, known)
            # the parts run side by side: each its prompts over one context (or whole)
            units = await asyncio.gather(
                *(service.run(part.request, "HttpCompletions") for part in planned.parts), return_exceptions=True
            )
            failed = next((u for u in units if isinstance(u, BaseException)), None)
            if failed is not None:
                raise failed
            rid = request_ids.current() or request_ids.new_id()

            def answer() -> Response:
                parts = zip(planned.parts, units, strict=True)
                results = [read_likelihoods(part.request, unit.reply.answer) for part, unit in parts]
                prompts = completions.prompt_logprobs(planned, results, known)
                as_ids = body.return_tokens_as_token_ids
                return _encoded(
                    completions_response(planned, prompts, requests.tokenizer, as_ids, model_name(body.model), rid)
                )

            # a position is a dict in the response: a long echo is written off the event loop
            if planned.prompt_tokens > INLINE_ANSWER_TOKENS:
                return await asyncio.to_thread(answer)
            return answer()
        return outcome["response"]

    @app.get(
        "/tokenizer_info",
        response_model=TokenizerInfo,
        response_model_exclude_none=True,
        responses=ERRORS,
        summary="The served tokenizer's special tokens and chat template (vLLM /tokenizer_info)",
    )
    async def tokenizer_info() -> Any:
        with handled("HttpTokenizerInfo") as outcome:
            requests = service.accepting().requests
            return _encoded(TokenizerInfo(**requests.tokenizer_info()))
        return outcome["response"]

    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        response_model_exclude_none=True,
        responses=ERRORS,
        summary="Token ids of a text (vLLM /tokenize)",
    )
    async def tokenize(body: TokenizeRequest, request: Request) -> Any:
        with handled("HttpTokenize") as outcome:
            requests = service.accepting().requests
            ids = await validated(_body_bytes(request), requests.prompt_ids, body.prompt, body.add_special_tokens)
            assert requests.tokenizer is not None  # prompt_ids refused a model without one
            strs = requests.tokenizer.token_strings(ids) if body.return_token_strs else None
            return _encoded(
                TokenizeResponse(count=len(ids), max_model_len=requests.cfg.context_length, tokens=ids, token_strs=strs)
            )
        return outcome["response"]

    @app.post(
        "/detokenize",
        response_model=DetokenizeResponse,
        responses=ERRORS,
        summary="The text of token ids (vLLM /detokenize)",
    )
    async def detokenize(body: DetokenizeRequest, request: Request) -> Any:
        with handled("HttpDetokenize") as outcome:
            text = await validated(_body_bytes(request), service.accepting().requests.text_of, body.tokens)
            return _encoded(DetokenizeResponse(prompt=text))
        return outcome["response"]

    @app.get("/v1/models", response_model=ModelList, responses={503: ERRORS[503]}, summary="The served model")
    async def models() -> Any:
        served = service.served
        if not service.ready or served is None:
            return error(503, "the model is still loading; wait for /ready", "ServiceUnavailableError")
        card = ModelCard(
            id=served.name,
            created=int(service.started_at),
            max_model_len=served.context_length,
            sliding_window=served.sliding_window,
            max_position_embeddings=served.max_position_embeddings,
            tp_size=served.tp_size,
            dp_size=served.dp_size,
            hosts=served.hosts,
            model_axis_hosts=served.model_axis_hosts,
            template=served.template,
            template_reason=served.template_reason,
            head=served.head,
            label_names=list(served.label_names) or None,
            quantization=served.quantization,
            activation_quantization=served.activation_quantization or None,
            quantized_projections=served.quantized_projections or None,
            weight_bytes_per_device=served.weight_bytes_per_device,
            pooling=served.pooling,
            embedding_dimensions=served.embedding_dimensions,
            prompt_names=list(served.prompt_names) or None,
        )
        return ModelList(data=[card])

    @app.get("/health", response_model=Status, summary="Liveness: the process answers")
    async def health() -> Status:
        return Status(status="ok")

    @app.get(
        "/ready",
        response_model=Status,
        responses={503: {"model": Status, "description": "Loading or draining"}},
        summary="Readiness: 200 only when the model is loaded and the server is not draining",
    )
    async def ready() -> Any:
        failing = service.probe("/ready")  # the admin port's readiness, the same answer
        if failing:
            return JSONResponse(Status(status=failing).model_dump(exclude_none=True), status_code=503)
        shapes_ready = service.engine.shapes_ready if service.engine else 0
        return _encoded(Status(status="ready", call_shapes_ready=shapes_ready, call_shapes=service.call_shapes))

    return app
