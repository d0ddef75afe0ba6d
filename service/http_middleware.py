"""The HTTP API's ASGI middlewares (service/http_api.py adds them), outermost first: the
request id (bound to every log line and echoed as a header), bearer tokens, and the body size
limit."""

from __future__ import annotations

from typing import Any

from prefixscore.service.http_errors import error
from prefixscore.service.security import TokenFile
from prefixscore.telemetry import request_ids


class RequestIds:
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


class BodyLimit:
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


class BearerTokens:
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
