"""The HTTP API: SGLang's `/v1/score`, a Cohere/Jina/vLLM-style `/v1/rerank`, vLLM's and SGLang's
`/v1/classify`, `/v1/models`,
`/health`, `/ready` and `/openapi.json`, served by FastAPI on uvicorn in the process's
event loop (the gRPC server's too), on its own port.

Routes only map JSON onto the transport-neutral inputs of `engine/validation.py` (the one
validation pass gRPC shares) and hand the validated request to the core's `run` (service/core.py), the same
device loop and batcher as gRPC: items of HTTP and gRPC requests over one query ride in
the same device calls. Errors keep SGLang's shape,
`{"object": "error", "message", "type", "param", "code"}`, with `message` starting with
the field at fault: 400 bad input, 413 over a size limit, 429 queue full (Retry-After),
503 loading or draining, 504 deadline, 500 internal.

Every response carries `x-request-id` (the client's when well formed, else a new one),
which is also bound to every log line written while the request is handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import grpc
import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from prefixscore import prefix_key
from prefixscore.engine import heads
from prefixscore.engine.templates import ranked
from prefixscore.engine.validation import (
    ClassifyInput,
    InvalidInput,
    RerankInput,
    ScoreInput,
    Truncation,
    Validated,
    ValidatedRerank,
)
from prefixscore.service.core import Failure, ScoringService, internal_failure, validated
from prefixscore.service.security import TokenFile
from prefixscore.telemetry import request_ids
from prefixscore.telemetry.logs import event

log = logging.getLogger("prefixscore.http")

# gRPC status of a refused request -> HTTP status and the error `type` (OpenAI/SGLang names)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "BadRequestError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "TooManyRequests"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "GatewayTimeout"),
}


def _body_bytes(request: Request) -> int | None:
    """The body's size from Content-Length (None when the client streamed it chunked)."""
    length = request.headers.get("content-length")
    return int(length) if length and length.isdigit() else None


# ---- JSON bodies -------------------------------------------------------------------------------
class ErrorResponse(BaseModel):
    """SGLang's (and vLLM's) error body."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None = None
    code: int


class ScoringRequest(BaseModel):
    """SGLang's /v1/score request, field for field, plus prefixscore's options (all optional)."""

    model_config = ConfigDict(extra="ignore")

    query: str | list[int] | None = Field(None, description="Query text or token ids.")
    items: str | list[str] | list[list[int]] | None = Field(
        None, description="Item text(s) or token-id lists; a single string is one item."
    )
    label_token_ids: list[int] | None = Field(None, description="Token ids whose next-token probability is returned.")
    apply_softmax: bool = Field(False, description="Softmax over the label logits only (else full vocabulary).")
    item_first: bool = Field(False, description="Score item + query instead of query + item.")
    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    labels: list[str] | None = Field(None, description="Label strings (one token each) instead of label_token_ids.")
    truncate: Literal["none", "end"] = Field(
        "none", description="An item too long for the context: 'none' rejects (SGLang), 'end' keeps its start."
    )
    query_truncation: Literal["none", "left", "right"] = Field(
        "none", description="A query over max_query_tokens (or the context): 'left' keeps its end, 'right' its start."
    )
    max_query_tokens: int | None = Field(None, ge=0, description="With query_truncation: the most query tokens kept.")
    check_tokenization: bool = Field(
        False,
        description="Text inputs: report per item whether tokenizing query + item as one string (as SGLang does) "
        "gives other tokens than prefixscore's separate tokenization.",
    )
    messages: list[dict[str, Any]] | None = Field(
        None,
        description="Instead of query: a conversation; each item is a candidate next assistant turn (a reward "
        "model's candidates), rendered by the model's chat template. The conversation is the shared prefix.",
    )
    activation: Literal["auto", "none", "sigmoid", "softmax"] | None = Field(
        None,
        description="A classifier model (see /v1/models `head`): its logits as they are ('none'), each label's "
        "sigmoid, or their softmax; 'auto' (default): sigmoid for one label, softmax for several. Send no "
        "label_token_ids to a classifier.",
    )


class CachedTokens(BaseModel):
    cached_tokens: int


class ScoringUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: CachedTokens
    items: int
    truncated_query_tokens: int
    truncated_items: list[int]
    truncated_item_tokens: int


class ScoringResponse(BaseModel):
    """SGLang's /v1/score response."""

    scores: list[list[float]]
    model: str
    usage: ScoringUsage | None = None
    object: Literal["scoring"] = "scoring"
    joined_tokenization_differs: list[bool] | None = None
    label_names: list[str] | None = None  # a classifier: the name of each score column


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere/Jina document objects may carry more fields

    text: str


class RerankRequest(BaseModel):
    """Cohere / Jina / vLLM rerank request."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0, description="Return the top_n most relevant documents (0 or absent: all).")
    return_documents: bool = Field(True, description="Echo each document in its result.")
    max_tokens_per_doc: int | None = Field(None, ge=0, description="Cut each document to this many tokens.")
    instruction: str | None = Field(None, description="The template's task instruction (default: web search).")
    truncate: Literal["none", "end"] = Field("end", description="A document too long to fit: 'end' cuts it.")
    check_tokenization: bool = False


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None
    joined_tokenization_differs: bool | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    cached_tokens: int
    documents: int
    truncated_documents: list[int]
    truncated_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixscore"
    max_model_len: int  # the longest query + item served
    # the sliding layers' attention window (None: no layer slides)
    sliding_window: int | None = None
    max_position_embeddings: int  # what the model's configuration declares
    # the device mesh: devices on the model axis (tensor parallel) and the data axis (replicas)
    tp_size: int
    dp_size: int
    template: str | None = None
    # the output head: causal_lm (label tokens' probabilities) or sequence_classification
    head: str
    label_names: list[str] | None = None  # a classifier's labels (id2label), in score column order


class ClassifyRequest(BaseModel):
    """vLLM's and SGLang's /v1/classify request, plus prefixscore's `activation`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    input: str | list[str] | list[int] | list[list[int]] | None = Field(
        None, description="Text(s) or token ids to classify; inputs sharing a leading run of tokens share its prefill."
    )
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = Field(
        None,
        description="Instead of input: a conversation (vLLM's chat form), or several (one result each; e.g. one "
        "conversation with each candidate assistant turn), rendered by the model's chat template.",
    )
    truncate_prompt_tokens: int | None = Field(None, description="Keep each input's last n tokens (-1: all that fit).")
    user: str | None = Field(None, description="Accepted and ignored (OpenAI's end-user id).")
    use_activation: bool | None = Field(None, description="vLLM's: false returns raw logits (activation 'none').")
    activation: Literal["auto", "none", "sigmoid", "softmax"] | None = Field(
        None, description="As in /v1/score: a classifier's activation (default auto)."
    )


class ClassifyData(BaseModel):
    index: int
    label: str  # the label of the highest output
    probs: list[float]  # one per label, in label order
    num_classes: int


class ClassifyUsage(BaseModel):
    prompt_tokens: int  # every input whole, as a plain forward pass of each would see it
    total_tokens: int
    completion_tokens: int = 0
    # the inputs' shared leading tokens (start tokens included, whole pool pages), prefilled once
    # for all of them rather than once per input
    prefix_tokens: int
    prompt_tokens_details: CachedTokens  # of prefix_tokens, those already in the prefix cache
    truncated_inputs: list[int]  # indices of the inputs truncate_prompt_tokens cut


class ClassifyResponse(BaseModel):
    """vLLM's and SGLang's /v1/classify response."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: ClassifyUsage


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Status(BaseModel):
    status: str
    # /ready: device call shapes compiled so far, of those warm-up compiles (the rest compile in
    # the background while requests are served in the compiled ones)
    call_shapes_ready: int | None = None
    call_shapes: int | None = None


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [
        (400, "Bad input; `message` starts with the field at fault"),
        (413, "Over a size limit (items or tokens per request, body bytes)"),
        (429, "The queue is full; retry after the Retry-After header"),
        (503, "The model is loading or the server is draining"),
        (504, "The deadline passed before the items were scored"),
    ]
}


# ---- errors ------------------------------------------------------------------------------------
def error(status: int, message: str, err_type: str, param: str | None = None, headers=None) -> JSONResponse:
    body = ErrorResponse(message=message, type=err_type, param=param, code=status)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


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


def _invalid(err: InvalidInput) -> JSONResponse:
    if err.too_large:
        return error(413, str(err), "RequestTooLarge", err.field)
    return error(400, str(err), "BadRequestError", err.field)


def _refused(failure: Failure) -> JSONResponse:
    status, err_type = HTTP_STATUS.get(failure.code, (500, "InternalServerError"))
    headers = {}
    if failure.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(failure.retry_after_ms / 1000)))
    return error(status, failure.message, err_type, headers=headers)


def _field(loc: tuple) -> str:
    """pydantic's error location -> "documents[2].text" (without "body" and union branch names)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (isinstance(part, str) and ("[" in part or part in ("str", "int", "RerankDocument"))):
            out += f".{part}" if out else str(part)
    return out or "body"


def _bad_body(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = _field(tuple(errors[0]["loc"])) if errors else "body"
    seen: dict[str, str] = {}
    for e in errors:  # one message per field (a union reports each branch)
        seen.setdefault(_field(tuple(e["loc"])), e["msg"])
    message = "; ".join(f"{field}: {msg}" for field, msg in seen.items())
    return error(400, message, "BadRequestError", first)


# ---- one body in, one response body out: the routes' and `prefixscore batch`'s (offline/) ------
def score_input(body: ScoringRequest) -> ScoreInput:
    """A /v1/score body as the transport-neutral input of the one validation pass."""
    items = [body.items] if isinstance(body.items, str) else body.items
    return ScoreInput(
        query=body.query,
        items=items,
        label_token_ids=body.label_token_ids or (),
        labels=body.labels or (),
        apply_softmax=body.apply_softmax,
        item_first=body.item_first,
        truncate=body.truncate,
        query_truncation=body.query_truncation,
        max_query_tokens=body.max_query_tokens,
        check_tokenization=body.check_tokenization,
        activation=body.activation or "auto",
        messages=body.messages,
    )


def _label_names(service: ScoringService) -> tuple[str, ...]:
    """The served classifier's label names (none for a causal LM, or before a model is loaded)."""
    return service.loaded.cfg.label_names if service.loaded else ()


def rerank_input(body: RerankRequest) -> RerankInput:
    """A /v1/rerank body as the transport-neutral input of the one validation pass."""
    return RerankInput(
        query=body.query,
        documents=[d if isinstance(d, str) else d.text for d in body.documents],
        instruction=body.instruction,
        top_n=body.top_n,
        return_documents=body.return_documents,
        max_tokens_per_doc=body.max_tokens_per_doc,
        truncate=body.truncate,
        check_tokenization=body.check_tokenization,
    )


def score_response(
    checked: Validated, scores: np.ndarray | None, cached: int, model: str, label_names: Sequence[str] = ()
) -> ScoringResponse:
    """The /v1/score response of a validated request; `scores` None when it had no items;
    label_names: a classifier's (its scores' columns), none for a causal LM."""
    req = checked.request
    return ScoringResponse(
        scores=[] if scores is None else scores.tolist(),
        model=model,
        usage=_score_usage(req.prompt_tokens, cached, len(req.items), checked.truncation),
        joined_tokenization_differs=checked.joined_differs,
        label_names=list(label_names) or None,
    )


def rerank_response(
    body: RerankRequest, checked: ValidatedRerank, scores: np.ndarray | None, cached: int, model: str, rid: str
) -> dict[str, Any]:
    """The /v1/rerank response of a validated request as plain data (`RerankResponse`'s shape):
    a model per result cost more host time than the rest of the response."""
    req = checked.scored.request
    results: list[dict[str, Any]] = []
    differs = checked.scored.joined_differs
    for r in ranked(scores, checked.top_n) if scores is not None else ():
        result: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if body.return_documents:
            doc = body.documents[r.index]
            result["document"] = {"text": doc} if isinstance(doc, str) else doc.model_dump()
        if differs:
            result["joined_tokenization_differs"] = differs[r.index]
        results.append(result)
    t = checked.scored.truncation
    usage = {
        "prompt_tokens": req.prompt_tokens,
        "total_tokens": req.prompt_tokens,
        "cached_tokens": cached,
        "documents": len(req.items),
        "truncated_documents": list(t.items),
        "truncated_tokens": t.item_tokens,
    }
    return {"id": f"rerank-{rid}", "model": model, "results": results, "usage": usage}


# ---- the app -----------------------------------------------------------------------------------
class _RequestIds:
    """ASGI middleware: bind the request id for the whole request and echo it as a header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v.decode("latin-1") for k, v in scope["headers"] if k == request_ids.HEADER.encode()), None)
        rid = request_ids.accept(sent)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (request_ids.HEADER.encode(), rid.encode())]
            await send(message)

        with request_ids.bound(rid):
            await self.app(scope, receive, send_with_id)


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes (--max-message-bytes, as for gRPC) is
    refused with 413 before it is parsed; the body is read here once and handed on whole."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        body = bytearray()
        too_large = int(declared) > self.limit if declared.isdigit() else False
        more = not too_large
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nothing to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            too_large = len(body) > self.limit
            more = more and not too_large
        if too_large:
            refusal = error(413, f"request body: over the limit of {self.limit} bytes", "RequestTooLarge")
            await refusal(scope, receive, send)
            return
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if delivered:
                return await receive()  # a disconnect, if the app listens for one
            delivered = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class _BearerTokens:
    """ASGI middleware: every path but the probes needs `Authorization: Bearer <token>`
    (security.TokenFile: constant-time compare, re-read on change); else 401."""

    EXEMPT = ("/health", "/ready")

    def __init__(self, app: Any, tokens: TokenFile) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            await self.app(scope, receive, send)
            return
        sent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if self.tokens.accepts(sent):
            await self.app(scope, receive, send)
            return
        refusal = error(401, "missing or invalid bearer token", "Unauthorized", headers={"WWW-Authenticate": "Bearer"})
        await refusal(scope, receive, send)


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
    app.add_middleware(_BodyLimit, limit=service.config.max_message_bytes)
    if tokens is not None:  # outside the body limit: a refused client's body is never read
        app.add_middleware(_BearerTokens, tokens=tokens)
    app.add_middleware(_RequestIds)  # added last: outermost, so refusals carry the request id too

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad_body(exc)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else "HTTPError")

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
                outcome["response"] = _invalid(err)
            except Failure as failure:
                counted.status = failure.code.name
                outcome["response"] = _refused(failure)
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
            scores, cached = (unit.scores, unit.cached_tokens) if unit else (None, 0)
            key = prefix_key.for_score(body.query) if body.query is not None else None
            return _encoded(score_response(checked, scores, cached, model_name(body.model), _label_names(service)), key)
        return outcome["response"]

    @app.post(
        "/v1/classify",
        response_model=ClassifyResponse,
        responses=ERRORS,
        summary="Classify inputs (vLLM / SGLang /v1/classify): a classifier's head, or a causal LM's label tokens",
    )
    async def classify(body: ClassifyRequest, request: Request) -> Any:
        with handled("HttpClassify") as outcome:
            activation = body.activation or ("none" if body.use_activation is False else "auto")
            if body.use_activation is False and activation != "none":
                raise InvalidInput("use_activation", f"false contradicts activation {activation!r}")
            inp = ClassifyInput(
                body.input, body.truncate_prompt_tokens, activation, service.config.classify_labels, body.messages
            )
            checked = await validated(_body_bytes(request), service.accepting().classify, inp)
            req = checked.request
            unit = await service.run(req, "HttpClassify")
            names = checked.label_names
            data = [
                ClassifyData(index=j, label=names[int(row.argmax())], probs=row.tolist(), num_classes=len(names))
                for j, row in enumerate(unit.scores)
            ]
            rid = request_ids.current() or request_ids.new_id()
            usage = ClassifyUsage(
                prompt_tokens=checked.prompt_tokens,
                total_tokens=checked.prompt_tokens,
                prefix_tokens=len(req.prefix),
                prompt_tokens_details=CachedTokens(cached_tokens=unit.cached_tokens),
                truncated_inputs=list(checked.truncated_inputs),
            )
            response = ClassifyResponse(
                id=f"classify-{rid}", created=int(time.time()), model=model_name(body.model), data=data, usage=usage
            )
            return _encoded(response)
        return outcome["response"]

    async def rerank(body: RerankRequest, request: Request) -> Any:
        with handled("HttpRerank") as outcome:
            inp = rerank_input(body)
            checked = await validated(_body_bytes(request), service.accepting().rerank, inp)
            req = checked.scored.request
            unit = await service.run(req, "HttpRerank") if req.items else None
            scores, cached = (unit.scores, unit.cached_tokens) if unit else (None, 0)
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

    @app.get("/v1/models", response_model=ModelList, responses={503: ERRORS[503]}, summary="The served model")
    async def models() -> Any:
        if not service.ready or service.loaded is None:
            return error(503, "the model is still loading; wait for /ready", "ServiceUnavailableError")
        loaded = service.loaded
        card = ModelCard(
            id=loaded.name,
            created=int(service.started_at),
            max_model_len=loaded.cfg.context_length,
            sliding_window=loaded.cfg.sliding_window,
            max_position_embeddings=loaded.cfg.max_position_embeddings,
            tp_size=service.engine.layout.shape.model,
            dp_size=service.engine.layout.shape.data,
            template=service.template.name if service.template else None,
            head=heads.head_kind(loaded.cfg),
            label_names=list(loaded.cfg.label_names) or None,
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


def _score_usage(prompt_tokens: int, cached: int, items: int, t: Truncation) -> ScoringUsage:
    return ScoringUsage(
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens,
        prompt_tokens_details=CachedTokens(cached_tokens=cached),
        items=items,
        truncated_query_tokens=t.query_tokens,
        truncated_items=list(t.items),
        truncated_item_tokens=t.item_tokens,
    )


class _OneSendPerStep:
    """A connection's transport that joins what one step of the event loop writes into one send.
    uvicorn writes a response's status line and headers, then its body, as two writes, and an
    asyncio transport sends each at once: two system calls per small response, which cost more
    host time than building the response. Both writes come in the same step (nothing awaits
    between them), so they leave together at the end of it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            data, self._pending = b"".join(self._pending), []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()  # what was written before the close still goes
        self._transport.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._flush()
        self._transport.set_protocol(protocol)

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's own
        return getattr(self._transport, name)


class _HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a transport that sends a response in one system call."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_OneSendPerStep(transport, self.loop))  # type: ignore[arg-type]


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a process that owns its signals: SIGTERM drains gRPC and HTTP together
    (cli.py), so uvicorn must not install handlers of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """The HTTP API on `host:port`, in the running event loop (the process's, shared with gRPC)."""

    def __init__(
        self,
        service: ScoringService,
        host: str,
        port: int,
        tokens: TokenFile | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.app = build_app(service, tokens)
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self._uvicorn: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Listen now (a taken port fails here); returns the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        sock.setblocking(False)
        # the socket listens already: connections queue in its backlog until uvicorn accepts them
        config = uvicorn.Config(
            self.app, http=_HttpProtocol, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30
        )
        config.load()
        config.ssl = self.ssl_context  # ours, not uvicorn's: it follows rotated certificate files
        self._uvicorn = _EmbeddedServer(config)
        self._task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self._uvicorn is not None and self._task is not None:
            self._uvicorn.should_exit = True
            await self._task
            self._uvicorn = self._task = None
