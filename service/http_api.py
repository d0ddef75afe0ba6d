"""The HTTP API: SGLang's `/v1/score`, a Cohere/Jina/vLLM-style `/v1/rerank`, vLLM's and SGLang's
`/v1/classify`, OpenAI's `/v1/completions` as scorers call it (echo and logprobs) and its
`/v1/embeddings` (a sentence-transformers checkpoint's pooling, engine/requests/embedding.py), Text
Embeddings Inference's `/embed`, vLLM's
`/tokenize`, `/detokenize` and `/tokenizer_info`, `/v1/models`,
`/health`, `/ready` and `/openapi.json`, served by FastAPI on uvicorn in the process's
event loop (the gRPC server's too), on its own port.

Routes only map JSON onto a request kind's input (engine/requests/kind.py: the one validation
gRPC shares) and hand it to the core's `serve` (service/core.py), the same device loop and
batcher as gRPC: items of HTTP and gRPC requests over one query ride in the same device calls.
`POST /v1/run/{kind}` serves any kind by name, its input's fields as the JSON body. Errors keep SGLang's shape,
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
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.exceptions import HTTPException

from prefixscore import prefix_key
from prefixscore.engine.requests.embedding import EmbedInput
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Served, input_of, plain
from prefixscore.service.core import ScoringService, validated
from prefixscore.service.failures import Failure, internal_failure
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
    RunResponse,
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

    def api(method: str, path: str, model: Any, summary: str, **more: Any) -> Callable:
        """A route and what the OpenAPI document says of it: its response model (its handler encodes
        the response itself), its errors and its summary."""
        return app.api_route(path, methods=[method], response_model=model, responses=ERRORS, summary=summary, **more)

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

    @api("POST", "/v1/score", ScoringResponse, "Score items against a query (SGLang /v1/score)")
    async def score(body: ScoringRequest, request: Request) -> Any:
        with handled("HttpScore") as outcome:
            answer = await service.serve(
                service.accepting()["score"], score_input(body), "HttpScore", _body_bytes(request)
            )
            key = prefix_key.for_score(body.query) if body.query is not None else None
            names = _label_names(service)
            return _encoded(
                score_response(answer.plan, answer.result, answer.cached_tokens, model_name(body.model), names), key
            )
        return outcome["response"]

    async def embedded(inp: EmbedInput, size: int | None) -> Served:
        """An embedding request served (its plan, its embeddings, its tokens read from the prefix cache)."""
        return await service.serve(service.accepting()["embed"], inp, "HttpEmbed", size)

    @api("POST", "/v1/embeddings", EmbeddingResponse, "Embed inputs (OpenAI /v1/embeddings)")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        """Pooled as the checkpoint's sentence-transformers modules say."""
        with handled("HttpEmbed") as outcome:
            inp = embed_input(body)
            answer = await embedded(inp, _body_bytes(request))
            model = model_name(body.model)
            response = embed_response(answer.plan, answer.result, answer.cached_tokens, model, body.encoding_format)
            return _encoded(response, prefix_key.for_embed(inp.prompt_name))
        return outcome["response"]

    @api("POST", "/embed", list[list[float]], "Embed inputs (Text Embeddings Inference's /embed)")
    async def tei_embed(body: EmbedRequest, request: Request) -> Any:
        """One list of floats per input."""
        with handled("HttpEmbed") as outcome:
            inp = tei_embed_input(body)
            answer = await embedded(inp, _body_bytes(request))
            return _json(to_json(answer.result.tolist()), prefix_key.for_embed(inp.prompt_name))
        return outcome["response"]

    @api("POST", "/v1/classify", ClassifyResponse, "Classify inputs (vLLM / SGLang /v1/classify)")
    async def classify(body: ClassifyRequest, request: Request) -> Any:
        """By a classifier's head, or a causal LM's label tokens."""
        with handled("HttpClassify") as outcome:
            inp = classify_input(body, service.config.classify_labels)
            answer = await service.serve(service.accepting()["classify"], inp, "HttpClassify", _body_bytes(request))
            rid = request_ids.current() or request_ids.new_id()
            model = model_name(body.model)
            return _encoded(classify_response(answer.plan, answer.result, answer.cached_tokens, model, rid))
        return outcome["response"]

    async def rerank(body: RerankRequest, request: Request) -> Any:
        with handled("HttpRerank") as outcome:
            answer = await service.serve(
                service.accepting()["rerank"], rerank_input(body), "HttpRerank", _body_bytes(request)
            )
            rid = request_ids.current() or request_ids.new_id()
            response = rerank_response(
                body, answer.plan, answer.result, answer.cached_tokens, model_name(body.model), rid
            )
            return _json(to_json(response), prefix_key.for_rerank(body.query, body.instruction))
        return outcome["response"]

    summary = "Rerank documents by relevance to a query (Cohere / Jina / vLLM shape)"
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        # one documented path; the others are aliases
        api("POST", path, RerankResponse, summary, include_in_schema=path == "/v1/rerank")(rerank)

    @api("POST", "/v1/completions", CompletionsResponse, "Log-probs of whole prompts (OpenAI /v1/completions)")
    async def complete(body: CompletionsRequest, request: Request) -> Any:
        """Every prompt token's log-prob and the greedy next token: echo, logprobs, max_tokens 0 or 1."""
        with handled("HttpCompletions") as outcome:
            kinds = service.accepting()
            # the parts run side by side: each its prompts over one context (or whole)
            served = await service.serve(
                kinds["completions"], completions_input(body), "HttpCompletions", _body_bytes(request)
            )
            rid = request_ids.current() or request_ids.new_id()

            def answer() -> Response:
                planned, as_ids, model = served.plan, body.return_tokens_as_token_ids, model_name(body.model)
                tokenizer = kinds.requests.tokenizer
                return _encoded(completions_response(planned, served.result, tokenizer, as_ids, model, rid))

            # a position is a dict in the response: a long echo is written off the event loop
            if served.plan.prompt_tokens > INLINE_ANSWER_TOKENS:
                return await asyncio.to_thread(answer)
            return answer()
        return outcome["response"]

    @api("POST", "/v1/run/{kind}", RunResponse, "Serve a request of any kind by name")
    async def run(kind: str, request: Request) -> Any:
        """score, likelihood, rerank, classify, completions, embed, or a kind added to the server:
        its input's fields as the body, its result as JSON."""
        with handled("HttpRun") as outcome:
            served_kind = service.accepting()[kind]
            try:
                fields = await request.json()
            except ValueError as err:
                raise InvalidInput("body", f"is not JSON: {err}") from err
            answer = await service.serve(served_kind, input_of(served_kind, fields), "HttpRun", _body_bytes(request))
            return _json(to_json({"kind": kind, "result": plain(answer.result), "usage": answer.usage()}))
        return outcome["response"]

    @api(
        "GET",
        "/tokenizer_info",
        TokenizerInfo,
        "The served tokenizer's special tokens and chat template (vLLM /tokenizer_info)",
    )
    async def tokenizer_info() -> Any:
        with handled("HttpTokenizerInfo") as outcome:
            requests = service.accepting().requests
            return _encoded(TokenizerInfo(**requests.tokenizer_info()))
        return outcome["response"]

    @api("POST", "/tokenize", TokenizeResponse, "Token ids of a text (vLLM /tokenize)")
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

    @api("POST", "/detokenize", DetokenizeResponse, "The text of token ids (vLLM /detokenize)")
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
        return ModelList(data=[ModelCard.of(served, created=int(service.started_at))])

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
