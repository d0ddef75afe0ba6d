"""Prometheus metrics of the service. One `ServiceMetrics` per server, on its own registry
(so several servers in one process, as in tests, never share counters).

Conventions: `prefixscore_` prefix, base units (`_seconds`, `_bytes`), counters end
in `_total`, labels are low-cardinality (method, gRPC code, kind).
deploy/ (Prometheus rules, Grafana dashboards, HPA) queries exactly these names;
tests check that every name used there is exported here.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixscore.telemetry.compiles import CompileCounter
from prefixscore.telemetry.host_cost import ThreadCpuCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a call sent to the followers: tens of microseconds on loopback, more over a network
STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        r.register(ThreadCpuCollector())  # host cost by thread kind (telemetry/host_cost.py)
        self.model_info = Info("prefixscore_model", "The served model.", registry=r)
        self.requests = Counter(
            "prefixscore_requests_total",
            "RPCs finished, by method and gRPC status code.",
            ["method", "code"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "prefixscore_request_duration_seconds",
            "RPC latency from arrival to last response.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_batch_seconds = Histogram(
            "prefixscore_time_to_first_batch_seconds",
            "Time from arrival of item work to its first scored batch.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.items_scored = Counter("prefixscore_items_scored_total", "Items scored.", registry=r)
        self.tokens = Counter(
            "prefixscore_tokens_total", "Tokens run on the device, by kind (prefix, item).", ["kind"], registry=r
        )
        self.padding_tokens = Counter(
            "prefixscore_padding_tokens_total", "Padding tokens run on the device in item batches.", registry=r
        )
        # a call's buckets less the tiles of padding alone a CPU skips (model/decoder.py per_tile);
        # on an accelerator, tokens_total + padding_tokens_total
        self.computed_tokens = Counter(
            "prefixscore_computed_tokens_total",
            "Tokens whose per-token work (projections, norms, MLP) ran on the device: real tokens and the "
            "padding computed beside them.",
            registry=r,
        )
        # against computed_tokens_total: the work paid for tokens nobody asked for, or for the same
        # token twice
        self.requested_tokens = Counter(
            "prefixscore_requested_tokens_total",
            "Tokens the requests need computed, each once (a prefix the prefix cache holds, or a position an "
            "earlier request computed, is not needed again).",
            registry=r,
        )
        self.batch_size = Histogram(
            "prefixscore_device_batch_size",
            "Items per device batch (before padding).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_padding = Histogram(
            "prefixscore_device_batch_padding_ratio",
            "Share of a device batch's tokens that are padding.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "prefixscore_device_batch_duration_seconds",
            "Device time per batch, by kind (prefill, items).",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "prefixscore_queue_depth", "Items waiting for the device (autoscaling signal).", registry=r
        )
        self.queue_capacity = Gauge(
            "prefixscore_queue_capacity", "Items the queue admits before RESOURCE_EXHAUSTED.", registry=r
        )
        self.call_shapes = Gauge(
            "prefixscore_call_shapes",
            "Device call shapes warm-up compiles (state=all) and those compiled so far (state=compiled); "
            "requests are served from the compiled ones while the rest compile in the background.",
            ["state"],
            registry=r,
        )
        self.inflight = Gauge("prefixscore_inflight_requests", "RPCs in progress (unary and streams).", registry=r)
        self.open_streams = Gauge("prefixscore_open_streams", "ScoreStream and EmbedStream sessions open.", registry=r)
        self.rejected = Counter(
            "prefixscore_rejected_total", "Requests refused by admission control (queue full).", registry=r
        )
        self.nonfinite = Counter(
            "prefixscore_nonfinite_scores_total",
            "Requests failed (INTERNAL) because the device returned NaN or Inf scores.",
            registry=r,
        )
        self.failed_calls = Counter(
            "prefixscore_failed_calls_total",
            "Device calls that failed (launch or read-back); their work was retried in calls of its own.",
            registry=r,
        )
        self.failed_alone = Counter(
            "prefixscore_failed_alone_total",
            "Requests failed (INTERNAL) because their work failed again in a device call of its own.",
            registry=r,
        )
        self.stream_backpressure = Counter(
            "prefixscore_stream_backpressure_total",
            "Times a stream stopped reading because its client had the maximum of unsent results.",
            registry=r,
        )
        self.streams_idle_closed = Counter(
            "prefixscore_streams_idle_closed_total",
            "Streams ended for neither sending nor reading within the idle timeout.",
            registry=r,
        )
        self.cache_hits = Counter("prefixscore_prefix_cache_hits_total", "Prefix cache hits.", registry=r)
        self.cache_misses = Counter(
            "prefixscore_prefix_cache_misses_total", "Prefix cache misses (prefills).", registry=r
        )
        self.cache_evictions = Counter(
            "prefixscore_prefix_cache_evictions_total", "Prefix cache evictions.", registry=r
        )
        self.cache_bytes = Gauge("prefixscore_prefix_cache_bytes", "Device bytes held by the prefix cache.", registry=r)
        self.pool_bytes = Gauge(
            "prefixscore_prefix_pool_bytes", "Device bytes of the prefix pool (allocated once at start).", registry=r
        )
        self.cache_entries = Gauge("prefixscore_prefix_cache_entries", "Prefixes held by the prefix cache.", registry=r)
        self.cache_pinned = Gauge(
            "prefixscore_prefix_cache_pinned",
            "Cached prefixes pinned by open streams or queued requests (0 when idle: a leak shows).",
            registry=r,
        )
        # what the Gateway API Inference Extension's endpoint picker reads to score replicas
        # (deploy/k8s/components/inference-gateway): its TotalQueuedRequests, TotalRunningRequests,
        # KVCacheUtilization, and vLLM's cache_config_info shape for the page size and count
        self.queued_requests = Gauge(
            "prefixscore_queued_requests",
            "Requests (and stream batches or opens) with work not yet in a device call.",
            registry=r,
        )
        self.running_requests = Gauge(
            "prefixscore_running_requests",
            "Requests (and stream batches) whose work is all in device calls, not yet answered.",
            registry=r,
        )
        self.pool_usage = Gauge(
            "prefixscore_prefix_pool_usage_ratio",
            "Share of the prefix pool's pages held by queries in use and by the queries they take leading tokens"
            " from, 0-1 (idle cached queries count as free).",
            registry=r,
        )
        self.pool_info = Gauge(
            "prefixscore_prefix_pool_info",
            "The prefix pool's page size in tokens (block_size) and its pages (num_gpu_blocks); value 1.",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        )
        self.mesh_devices = Gauge(
            "prefixscore_mesh_devices",
            "Devices on each axis of the device mesh: model (tensor parallel) and data (replicas).",
            ["axis"],
            registry=r,
        )
        self.template_check_passed = Gauge(
            "prefixscore_template_check_passed",
            "The reranker template's known-answer check at start: 1 when the relevant document won every "
            "built-in triple, 0 when not (absent: not run).",
            ["template"],
            registry=r,
        )
        # read when scraped: a background warm-up's compiles show while no request runs
        r.register(_CompilesCollector())
        self.hosts = Gauge(
            "prefixscore_hosts",
            "Hosts (processes) serving this model together: the group's size, and those ready (a replica of "
            "one host: 1 and 1).",
            ["state"],
            registry=r,
        )
        self.step_send_seconds = Histogram(
            "prefixscore_step_send_seconds",
            "Several hosts, on the leader: seconds to send one call to every follower before it launches.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_send_bytes = Counter(
            "prefixscore_step_send_bytes_total",
            "Several hosts, on the leader: bytes of the calls sent, one follower's copy.",
            registry=r,
        )


class FollowerMetrics:
    """What a follower host exports (it serves no API): its place in the group, readiness, the
    calls it ran, its compilations (steady state compiles nothing here either) and the bytes its
    devices hold. `stats()` is read at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(ThreadCpuCollector())
        self.host = Info("prefixscore_host", "This host's place in its group.", registry=r)
        self.ready = Gauge("prefixscore_host_ready", "1 once loaded, compiled and checked.", registry=r)
        r.register(_StatsCollector(stats))


class _CompilesCollector(Collector):
    """The process's XLA compilations and the seconds spent obtaining executables, as counted
    (telemetry/compiles.py) at the moment of the scrape."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "prefixscore_compilations",
            "XLA compilations since start (an executable loaded from the persistent cache is not one).",
            value=CompileCounter.count(),
        )
        yield CounterMetricFamily(
            "prefixscore_compile_seconds",
            "Seconds spent obtaining executables since start (compiling, or loading from the persistent cache).",
            value=CompileCounter.seconds(),
        )


class _StatsCollector(Collector):
    """A follower's counters and gauges, read from its loop's stats when scraped."""

    KINDS = {
        "calls": ("prefixscore_host_calls", "counter", "Device calls run as the leader sent them."),
        "compilations": ("prefixscore_compilations", "counter", "XLA compilations since start."),
        "weight_bytes": ("prefixscore_weight_bytes_per_device", "gauge", "Bytes of weights on the fullest device."),
        "device_bytes_in_use": ("prefixscore_device_memory_in_use_bytes", "gauge", "Device memory in use (max)."),
    }

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        for key, value in self._stats().items():
            name, kind, doc = self.KINDS[key]
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=value)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # scrapes are not worth a log line each
        pass


def serve_metrics(
    host: str, port: int, registry: CollectorRegistry, probes: Callable[[str], str | None] | None = None
) -> WSGIServer:
    """Serve `registry` at GET /metrics, and with `probes` the plaintext probes /health and /ready
    (any other path: 404), on a daemon thread; returns the server (`.server_port`, `.shutdown()`).
    prometheus-client's own server answers every path.

    probes(path) -> None when the probe passes, else why not (503). The probes live here, on the
    port kept apart from the API, because kubelet cannot present a client certificate: with
    mutual TLS on the API its gRPC and HTTPS probes could never pass."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response):  # noqa: ANN202 - the WSGI signature
        path = environ.get("PATH_INFO")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if probes is not None and path in ("/health", "/ready"):
            failing = probes(path)
            start_response("503 Service Unavailable" if failing else "200 OK", [("Content-Type", "text/plain")])
            return [f"{failing or 'ok'}\n".encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found; metrics are at /metrics\n"]

    server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in host else _Server
    server = make_server(host, port, app, server_class=server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="prefixscore-metrics", daemon=True).start()
    return server
