"""The HTTP API (service/http_api.py) served by uvicorn in the process's event loop, the one
the gRPC server runs in, on its own port.

uvicorn is patched in two places, both below: its httptools protocol writes through a
transport that joins a response's writes into one send (`_OneSendPerStep`: two system calls per
small response cost more host time than building it), and its server installs no signal
handlers (`_EmbeddedServer`: the process drains gRPC and HTTP together on SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from prefixscore.service.core import ScoringService
from prefixscore.service.http_api import build_app
from prefixscore.service.security import TokenFile


# uvicorn, patched (why: the module's docstring): a protocol that sends each response in one
# system call, and a server that leaves the signals to the process
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
