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
from typing import Any

import grpc
from grpc_health.v1 import health

log = logging.getLogger("prefixscore.security")

AUTH_HEADER = "authorization"
EXEMPT_PREFIXES = (f"/{health.SERVICE_NAME}/",)


def _stamp(paths: list[str]) -> tuple[tuple[int, int], ...]:
    stats = [os.stat(p) for p in paths]
    return tuple((s.st_mtime_ns, s.st_size) for s in stats)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class _CertificateFiles:
    """The server's certificate configuration, re-read from its files when they change."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        self.paths = [cert, key] + ([client_ca] if client_ca else [])
        self.client_ca = client_ca
        self._stamp: tuple[tuple[int, int], ...] | None = None
        self._lock = threading.Lock()

    def load(self) -> grpc.ServerCertificateConfiguration:
        cert, key = _read(self.paths[0]), _read(self.paths[1])
        ca = _read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before handshakes: a new configuration when a file changed, else None
        (keep the current one). A half-written file (rotation in progress) keeps the old one."""
        with self._lock:
            try:
                stamp = _stamp(self.paths)
                if stamp == self._stamp:
                    return None
                config = self.load()
            except (OSError, ValueError) as err:
                log.warning("certificate reload skipped: %s", err)
                return None
            if self._stamp is not None:
                log.info("certificates reloaded from %s", self.paths)
            self._stamp = stamp
            return config


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with `client_ca`, mutual TLS (clients must present a
    certificate it signed). The files are re-read when they change."""
    files = _CertificateFiles(cert, key, client_ca)
    initial = files.load()  # fail at start, not at the first handshake, when the files are bad
    files._stamp = _stamp(files.paths)
    return grpc.dynamic_ssl_server_credentials(
        initial, files.fetch, require_client_authentication=client_ca is not None
    )


def _tls_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class _RotatingContext:
    """Swaps a freshly loaded context into each new handshake once the files changed (the
    server-name callback runs at every ClientHello, before the certificate is chosen)."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        self.files = (cert, key, client_ca)
        self.paths = [p for p in self.files if p]
        self.current = _tls_context(*self.files)
        self._stamp = _stamp(self.paths)
        self._lock = threading.Lock()

    def on_hello(self, conn: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        with self._lock:
            try:
                stamp = _stamp(self.paths)
                if stamp != self._stamp:
                    self.current = _tls_context(*self.files)
                    self._stamp = stamp
                    log.info("certificates reloaded from %s (HTTP)", self.paths)
            except (OSError, ssl.SSLError, ValueError) as err:  # mid-rotation: keep the old one
                log.warning("certificate reload skipped (HTTP): %s", err)
            conn.context = self.current


def http_ssl_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The HTTP API's TLS (mutual with `client_ca`) from the same PEM files as gRPC's, also
    picking up rotated files at new handshakes."""
    rotating = _RotatingContext(cert, key, client_ca)
    outer = _tls_context(cert, key, client_ca)
    outer.sni_callback = rotating.on_hello
    return outer


class TokenFile:
    """Accepted bearer tokens from a file, re-read when it changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[tuple[int, int], ...] | None = None
        self._tokens: tuple[bytes, ...] = ()
        self._lock = threading.Lock()
        self.tokens()  # a missing or empty file is an error at start
        if not self._tokens:
            raise ValueError(f"{path}: no tokens (one per line)")

    def tokens(self) -> tuple[bytes, ...]:
        with self._lock:
            try:
                stamp = _stamp([self.path])
                if stamp != self._stamp:
                    lines = _read(self.path).decode().splitlines()
                    self._tokens = tuple(t.strip().encode() for t in lines if t.strip() and not t.startswith("#"))
                    self._stamp = stamp
            except OSError as err:
                if self._stamp is None:
                    raise
                log.warning("token file reload skipped: %s", err)
            return self._tokens

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
