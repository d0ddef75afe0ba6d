"""Serving in tests: in-process servers and replicas over a tiny model, `prefixscore serve` as a
subprocess, scraping its metrics, and waiting for a condition."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prefixscore.bench import metrics
from prefixscore.service.core import ServerConfig
from prefixscore.service.process import ServerThread

LABELS = [28, 1017]  # two token ids of the tiny-qwen3 (SmolLM2) vocabulary
ITEMS = [[7, 8, 9], [100, 101], [250, 251, 252, 253]]  # three items of token ids, of three lengths
# the test servers' buckets: tiny-qwen3 compiles each in seconds, and every server, batch run and
# group of hosts given them compiles the same shapes (one compile cache for the run)
SERVE_BUCKETS = ["--max-prefill-tokens", "256", "--max-batch-tokens", "256"]
# `prefixscore serve` of tiny-qwen3 on free loopback ports, small buckets, no warm-up: up in seconds
SERVE = [
    "--model",
    "tiny-qwen3",
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--metrics-port",
    "0",
    "--http-port",
    "0",
    "--template",
    "none",
    "--warmup",
    "false",
    *SERVE_BUCKETS,
    "--drain-seconds",
    "60",
]


def server_config(scorer, **overrides) -> ServerConfig:
    """A loopback server (free ports) over an in-process Scorer's model and engine, not warmed up,
    serving Qwen3-Reranker's prompt (the test models are random: `auto` would recognize none)."""
    base = dict(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        loaded=scorer.model,
        engine=scorer.engine,
        warmup=False,
        template="qwen3-reranker",
    )
    return ServerConfig(**{**base, **overrides})


@contextlib.contextmanager
def serving_replicas(scorer, n: int = 3) -> Iterator[list[ServerThread]]:
    """`n` replicas of the scorer's model, each with its own engine and prefix pool (replicas of
    the scorer's engine: they share its executables, so no shape is traced or compiled again)."""
    servers: list[ServerThread] = []
    try:
        for _ in range(n):
            servers.append(ServerThread(server_config(scorer, engine=scorer.engine.replica(), http_port=0)).start())
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def scrape(port: int) -> dict[str, float]:
    """GET /metrics -> {"name{label=value,...}": value} for every sample."""
    return metrics.scrape(f"127.0.0.1:{port}")


def wait_for(condition: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> object:
    """Poll `condition` until it is truthy (returns it) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# the CLI as a serving image runs it, without torch (tests/helpers/cli_as_deployed.py)
AS_DEPLOYED = (str(Path(__file__).with_name("cli_as_deployed.py")),)


class ServerLog(list):
    """A served process's log events, appended as they come; `ended` is set once its stderr
    closed (the process exited and every line it wrote has been read)."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = threading.Event()

    def complete(self, timeout: float = 30.0) -> ServerLog:
        """Every event, once the process's last line has been read: a line written just before
        the process exits reaches this list after `wait()` returns, on the reader's thread."""
        assert self.ended.wait(timeout), f"stderr still open {timeout}s later: {self[-5:]}"
        return self


def serve_process(
    args: list[str], env: dict[str, str] | None = None, launcher: Sequence[str] = AS_DEPLOYED
) -> tuple[subprocess.Popen, ServerLog]:
    """`prefixscore serve ARGS --log-format json` as a subprocess (`launcher`: what python runs,
    by default the CLI without torch as deployed, or a script wrapping the CLI for a test), and its
    log events as they come (a thread reads stderr; a line that is not JSON becomes
    {"event": "raw", "line": ...}; ServerLog.complete() once it exited)."""
    proc = subprocess.Popen(
        [sys.executable, *launcher, "serve", *args, "--log-format", "json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false", **(env or {})},
    )
    events = ServerLog()

    def read_logs() -> None:
        for line in proc.stderr:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                events.append({"event": "raw", "line": line})
        events.ended.set()

    threading.Thread(target=read_logs, daemon=True).start()
    return proc, events
