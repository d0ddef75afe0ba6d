"""The HTTP API's refusals in SGLang's error shape, `{"object": "error", "message", "type",
"param", "code"}`, with `message` starting with the field at fault: a bad body (pydantic's
errors), an invalid input (the validation pass), or a refusal of the core (gRPC status ->
HTTP status). Shared by the routes, the middlewares and `prefixscore batch` (offline/)."""

from __future__ import annotations

import math

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from prefixscore.engine.requests.validation import InvalidInput
from prefixscore.service.core import Failure
from prefixscore.service.http_schemas import ErrorResponse

# gRPC status of a refused request -> HTTP status and the error `type` (OpenAI/SGLang names)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "BadRequestError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "TooManyRequests"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "GatewayTimeout"),
}


def error(
    status: int, message: str, err_type: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error response; `param`: the field at fault."""
    body = ErrorResponse(message=message, type=err_type, param=param, code=status)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def invalid(err: InvalidInput) -> JSONResponse:
    """The validation pass's refusal: 413 over a size limit, else 400."""
    if err.too_large:
        return error(413, str(err), "RequestTooLarge", err.field)
    return error(400, str(err), "BadRequestError", err.field)


def refused(failure: Failure) -> JSONResponse:
    """The core's refusal (queue full, loading, draining, deadline) by its gRPC status."""
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


def bad_body(exc: RequestValidationError) -> JSONResponse:
    """A body that does not fit its request model: 400, every field at fault in the message."""
    errors = exc.errors()
    first = _field(tuple(errors[0]["loc"])) if errors else "body"
    seen: dict[str, str] = {}
    for e in errors:  # one message per field (a union reports each branch)
        seen.setdefault(_field(tuple(e["loc"])), e["msg"])
    message = "; ".join(f"{field}: {msg}" for field, msg in seen.items())
    return error(400, message, "BadRequestError", first)
