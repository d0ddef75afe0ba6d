"""Transport security and authentication: TLS / mutual TLS that picks up rotated certificate
files (gRPC credentials; an SSLContext for the HTTP API), and bearer tokens (a gRPC
interceptor; the HTTP API's middleware uses the same TokenFile).

Certificates: cert-manager (or any rotation) rewrites the mounted files in place; gRPC asks
`_CertificateFiles.fetch` for the configuration at each new handshake, and it returns a new
one only when a file changed, so new connections get the new certificate without a restart
(open connections keep theirs).

Tokens: a file of accepted bearer tokens, one per line (blank lines and `#` comments
ignored), re-read when it changes. Every call but the health service's must send
`authorization: Bearer <token>`; a token is compared with each accepted one in constant
time (`hmac.compare_digest`, no early exit), so timing tells nothing about how much of it
matched. Health stays open: kubelet and load balancers probe without a token.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health

log = logging.getLogger("prefixscore.security")
T = TypeVar("T")

AUTH_HEADER = "authorization"
EXEMPT_PREFIXES = (f"/{health.SERVICE_NAME}/",)


def _stamp(paths: list[str]) -> tuple[tuple[int, int], ...]:
    stats = [os.stat(p) for p in paths]
    return tuple((s.st_mtime_ns, s.st_size) for s in stats)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class _Watched(Generic[T]):
    """A value loaded from files, loaded again when one of them changes (mtime or size): the
    one reload mechanism of certificates (gRPC and HTTP) and tokens. The first load's errors
    propagate (bad files fail at start); a later failed load, such as a rotation half written,
    keeps the previous value (logged)."""

    def __init__(self, paths: list[str], load: Callable[[], T], what: str) -> None:
        self.paths, self._load, self.what = paths, load, what
        self._lock = threading.Lock()
        self._stamp = _stamp(paths)
        self.value = load()

    def get(self) -> tuple[T, bool]:
        """The current value, and whether it was just loaded again."""
        with self._lock:
            try:
                stamp = _stamp(self.paths)
                if stamp != self._stamp:
                    self.value, self._stamp = self._load(), stamp
                    log.info("%s reloaded from %s", self.what, self.paths)
                    return self.value, True
            except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
                log.warning("%s reload skipped: %s", self.what, err)
            return self.value, False


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with `client_ca`, mutual TLS (clients must present a
    certificate it signed). The files are re-read when they change."""

    def load() -> grpc.ServerCertificateConfiguration:
        ca = _read(client_ca) if client_ca else None
        return grpc.ssl_server_certificate_configuration([(_read(key), _read(cert))], root_certificates=ca)

    files = _Watched([p for p in (cert, key, client_ca) if p], load, "certificates")

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # gRPC asks before handshakes: a new configuration, or None to keep the current one
        config, changed = files.get()
        return config if changed else None

    return grpc.dynamic_ssl_server_credentials(files.value, fetch, require_client_authentication=client_ca is not None)


def _tls_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def http_ssl_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The HTTP API's TLS (mutual with `client_ca`) from the same PEM files as gRPC's, also
    picking up rotated files at new handshakes: the server-name callback runs at every
    ClientHello, before the certificate is chosen, and swaps in the current context."""
    files = _Watched(
        [p for p in (cert, key, client_ca) if p], lambda: _tls_context(cert, key, client_ca), "certificates (HTTP)"
    )

    def on_hello(conn: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        conn.context = files.get()[0]

    outer = _tls_context(cert, key, client_ca)
    outer.sni_callback = on_hello
    return outer


class TokenFile:
    """Accepted bearer tokens from a file, re-read when it changes."""

    def __init__(self, path: str) -> None:
        def load() -> tuple[bytes, ...]:
            lines = _read(path).decode().splitlines()
            return tuple(t.strip().encode() for t in lines if t.strip() and not t.startswith("#"))

        self.path = path
        self._file = _Watched([path], load, "token file")  # a missing file is an error at start
        if not self._file.value:
            raise ValueError(f"{path}: no tokens (one per line)")

    def tokens(self) -> tuple[bytes, ...]:
        return self._file.get()[0]

    def accepts(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        sent = header[len("Bearer ") :].strip().encode()
        ok = False
        for token in self.tokens():
            ok |= hmac.compare_digest(sent, token)  # every token compared: no early exit
        return ok


def _refusal(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=None, response_serializer=None)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted bearer token (UNAUTHENTICATED); health is exempt."""

    def __init__(self, tokens: TokenFile) -> None:
        self.tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == AUTH_HEADER), None)
        if self.tokens.accepts(header if isinstance(header, str) else None):
            return handler
        return _refusal(handler, "missing or invalid bearer token (metadata 'authorization: Bearer <token>')")
