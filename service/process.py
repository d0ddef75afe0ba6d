"""One serving process: the core (service/core.py), the gRPC server (service/server.py),
the HTTP API (service/http_api.py, when a port is set) and the metrics endpoint, started
and stopped together.

Life cycle: `start()` listens at once with health NOT_SERVING, then the device loop loads
the model and compiles (warm-up) on its own thread; health turns SERVING when that is
done. `drain()` (SIGTERM) turns health NOT_SERVING, refuses new requests with
UNAVAILABLE, lets in-flight requests and open streams finish (up to a timeout), then
stops everything. When the device loop breaks the process stops with `exit_code` 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Awaitable
from typing import Any, NoReturn

from prefixscore.service import security
from prefixscore.service.core import ScoringService, ServerConfig
from prefixscore.service.http_server import HttpServer
from prefixscore.service.server import GrpcServer
from prefixscore.telemetry.logs import event
from prefixscore.telemetry.metrics import serve_metrics

log = logging.getLogger("prefixscore.server")


# a leader whose group lost a host exits within EXIT_PROMISE_S of noticing (README): requests in
# flight are answered UNAVAILABLE at once, the rest is the servers' shutdown, and a backstop ends
# the process GROUP_EXIT_S after the loss whatever still runs. The backstop fires a second before
# the promise: its own exit (the last line, waited for up to EXIT_FLUSH_S) must fit inside it
EXIT_PROMISE_S = 5.0
# the failure path exits after giving the requests it failed this long to be answered
GROUP_ANSWER_S = 1.0


# how long the last log lines may take to go out: a full pipe whose reader stalls must not keep
# a process that decided to exit alive
EXIT_FLUSH_S = 1.0
GROUP_EXIT_S = EXIT_PROMISE_S - EXIT_FLUSH_S


def exit_now(code: int) -> NoReturn:
    """End the process at once, after its last line (`exit`: when it decided to, which is what a
    bound on its exit can hold; the kernel's teardown of a large process after it can take seconds
    on a loaded machine) and a flush of what was written, waited for at most EXIT_FLUSH_S: no
    interpreter shutdown, whose hooks (joining compile threads, JAX's runtime shutdown barrier with
    every host) could wait."""

    def last_words() -> None:
        event(log, "exit", code=code)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()

    words = threading.Thread(target=last_words, name="prefixscore-exit", daemon=True)
    words.start()
    words.join(EXIT_FLUSH_S)
    os._exit(code)


def exit_after(seconds: float, code: int) -> None:
    """exit_now(code) in `seconds`, unless the process ended first (a backstop)."""
    timer = threading.Timer(seconds, exit_now, (code,))
    timer.daemon = True
    timer.start()


class ScoreServer:
    """The process's servers over one `ScoringService`; see the module doc. Use from one
    asyncio event loop."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # a lost group's process ends within EXIT_PROMISE_S of the loss being noticed, counted on
        # the thread that noticed it: the event loop may be slow to run `_failed` (a loaded machine)
        self.service = ScoringService(config, self._failed, on_group_lost=lambda: exit_after(GROUP_EXIT_S, 1))
        self.grpc = GrpcServer(self.service)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._http: HttpServer | None = None
        self._metrics_httpd: Any = None
        self._ready_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    @property
    def exit_code(self) -> int:
        """Non-zero when the device loop broke: the orchestrator must restart the process."""
        return self.service.exit_code

    async def start(self) -> None:
        """Listen (health NOT_SERVING), start the metrics endpoint, and start loading the model."""
        cfg = self.config
        tokens = security.TokenFile(cfg.auth_tokens_file) if cfg.auth_tokens_file else None
        self.port = await self.grpc.start(tokens)
        if cfg.metrics_port is not None:
            host = cfg.metrics_host or cfg.host
            self._metrics_httpd = serve_metrics(host, cfg.metrics_port, self.service.metrics.registry, self.probe)
            self.metrics_port = self._metrics_httpd.server_port
        if cfg.http_port is not None:
            tls = security.http_ssl_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
            self._http = HttpServer(self.service, cfg.host, cfg.http_port, tokens, tls)
            self.http_port = await self._http.start()
        event(
            log,
            "listening",
            host=cfg.host,
            port=self.port,
            metrics_port=self.metrics_port,
            http_port=self.http_port,
            tls=bool(cfg.tls_cert),
            mutual_tls=bool(cfg.tls_client_ca),
            auth_tokens=tokens is not None,
            reflection=cfg.reflection,
        )
        self.service.start()
        self._ready_task = asyncio.ensure_future(self._become_ready())

    async def _become_ready(self) -> None:
        await self.service.become_ready()
        if not self.service.draining:
            await self.grpc.set_serving(True)
        assert self.service.loaded is not None
        event(log, "ready", model=self.service.loaded.name, port=self.port, metrics_port=self.metrics_port)

    async def _failed(self, error: BaseException) -> None:
        """The device loop broke: health NOT_SERVING at once, then stop (exit_code is 1). A host
        of the group lost: whatever still waits (a collective that never completes), the process
        ends within EXIT_PROMISE_S."""
        await self.grpc.set_serving(False)
        if self.service.group.lost:
            # every request held was failed UNAVAILABLE and new ones are refused so: let their
            # answers go out, then end the process without stopping the servers (a server
            # stopping cancels the calls that reach it meanwhile, which nobody retries); clients
            # whose connection closes see UNAVAILABLE too (the backstop runs since the loss)
            await self.service.wait_idle(GROUP_ANSWER_S)
            event(log, "exiting", code=1, reason="host group lost")
            exit_now(1)
        await self.stop()

    def probe(self, path: str) -> str | None:
        """The admin port's probes (service/core.py `ScoringService.probe`)."""
        return self.service.probe(path)

    async def wait_ready(self) -> None:
        """Return once SERVING; raises StartupFailed if the model could not be loaded."""
        assert self._ready_task is not None, "start() first"
        await asyncio.shield(self._ready_task)

    async def drain(self, timeout: float | None = None) -> None:
        """Graceful stop: health NOT_SERVING, refuse new requests, finish in-flight ones, stop."""
        if self.service.draining:
            await self._stopped.wait()
            return
        self.service.draining = True
        timeout = self.config.drain_seconds if timeout is None else timeout
        service = self.service
        event(log, "draining", inflight=service.inflight, queued_items=service.worker.depth, timeout_s=timeout)
        await self.grpc.enter_graceful_shutdown()
        if not await self.service.wait_idle(timeout):
            event(log, "drain_timeout", level=logging.WARNING, inflight=self.service.inflight)
        await self.stop()

    async def stop(self) -> None:
        """Stop at once: cancel what is in flight, stop the device loop and the metrics endpoint."""
        self.service.draining = True
        await self.grpc.stop()
        if self._http is not None:
            await self._http.stop()
            self._http = None
        await self.service.stop()
        if self._metrics_httpd is not None:
            await asyncio.to_thread(self._metrics_httpd.shutdown)
            self._metrics_httpd.server_close()
            self._metrics_httpd = None
        if self._ready_task is not None and not self._ready_task.done():
            self._ready_task.cancel()
        event(log, "stopped")
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


class ServerThread:
    """A ScoreServer on its own event loop in a background thread (tests, notebooks).

    with ServerThread(ServerConfig(model="tiny-qwen3", port=0, host="127.0.0.1")) as srv:
        ScoreClient(srv.target).score(...)
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.server: ScoreServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="prefixscore-grpc", daemon=True)

    def _run(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def start(self, wait_ready: bool = True, timeout: float = 600.0) -> ServerThread:
        self._thread.start()

        async def create() -> ScoreServer:
            server = ScoreServer(self.config)
            await server.start()
            return server

        self.server = self._run(create(), timeout)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        assert self.server is not None
        self._run(self.server.wait_ready(), timeout)

    @property
    def target(self) -> str:
        assert self.server is not None
        host = self.config.host if self.config.host not in ("0.0.0.0", "[::]", "") else "127.0.0.1"
        return f"{host}:{self.server.port}"

    def drain(self, timeout: float | None = None) -> None:
        assert self.server is not None
        self._run(self.server.drain(timeout))

    def stop(self) -> None:
        """Stop the server (draining in-flight requests briefly) and the loop thread."""
        if self.server is not None and not self.server.stopped:
            self._run(self.server.drain(5.0))
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
