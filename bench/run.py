"""`prefixscore bench`: the workloads of docs/benchmarks.md, in process or over gRPC.

    prefixscore bench --model bench-cpu --workload w1-cold --mode prefix,packed,sequential --json out.json

Each (workload, mode) runs its warm-up requests first (compilation, prefix cache
fill), reported apart, then the timed runs. Throughput is items per second of wall
time from sending a request to its last score, the median over timed runs, with
p50/p95/p99 request latency. Model FLOPs per request (model/flops.py) over wall
time give achieved FLOP/s, reported against the device's measured peak: the best
of a large matmul timed in the same process before and after the workloads.

W2, W3-grpc (W3's requests from --concurrency clients) and W4 always go through
gRPC: to --target, or to a server started in this process on a free port (the same
engine; requests still cross the gRPC stack). They are concurrent runs: their
warm-up requests are sent concurrently too, and throughput and FLOP/s are totals
over the run's wall time. When the run has W1-cold (prefix), each W2/W3/W4 record
also gets its model FLOP rate as a share of W1-cold's (docs/benchmarks.md, "How
`prefixscore bench` measures"): whether real traffic keeps the device as busy as the
ideal request.

Host cost: with --serve-process the bench starts `prefixscore serve` in a process of
its own and runs every workload against it; each concurrent record then carries the
server's CPU time per request by thread kind (python, xla, grpc, other), read from its
`prefixscore_thread_cpu_seconds_total` before and after the timed run (telemetry/host_cost.py),
and requests/s. `host` is W4's shape for that measure (run it on the smallest preset,
`--model tiny-qwen3`, so the device work is small); `host-rerank` is HTTP /v1/rerank with
--rerank-docs text documents per request. Against a server already running, --target
with --metrics-target (and --http-target for host-rerank) reads the same figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import http.client
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prefixscore.bench import workloads as wl
from prefixscore.telemetry import host_cost

WORKLOADS = (
    "w1-cold",
    "w1-warm",
    "w2",
    "w3",
    "w3-grpc",
    "w4",
    "host",
    "host-rerank",
    "w5",
    "w6",
    "w6-one-by-one",
    "soak",
)
MODES = ("prefix", "packed", "sequential")
# many clients at once through gRPC (host-rerank: HTTP); the server runs its prefix path only
CONCURRENT = ("w2", "w3-grpc", "w4", "host", "host-rerank", "w5")
# W5 through a router, twice over new queries: clients sending the prefix key, then none
W5_MODES = ("affinity", "no-key")
# workloads whose model FLOP rate is reported as a share of W1-cold's
SHARED_WITH_W1_COLD = ("w2", "w3", "w3-grpc", "w4", "w6", "w6-one-by-one")
SHARE_KEY = "flop_rate_share_of_w1_cold"
# the same share with each rate taken against the matmul rate measured around it
UTIL_SHARE_KEY = "utilisation_share_of_w1_cold"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="run the benchmark workloads (docs/benchmarks.md)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bench-cpu", help="preset, directory, .gguf or hub id [%(default)s]")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="[%(default)s]")
    p.add_argument("--attention", default=None, help="attention implementation (default: the backend's)")
    p.add_argument("--devices", type=int, default=None, help="devices to use in process (default: all)")
    p.add_argument("--tp-size", type=int, default=None, help="in process: devices on the model axis (default: chosen)")
    p.add_argument("--dp-size", type=int, default=None, help="in process: devices on the data axis (default: the rest)")
    p.add_argument(
        "--compile-cache",
        default=None,
        help="persistent XLA compilation cache directory [$PREFIXSCORE_COMPILE_CACHE_DIR]",
    )
    p.add_argument("--target", default=None, help="host:port of a running server: every workload over gRPC")
    p.add_argument(
        "--serve-process",
        action="store_true",
        help="start `prefixscore serve` (this --model, --dtype, --attention, --compile-cache) in a process of "
        "its own and run every workload against it: its CPU time per request, by thread kind, is the host cost",
    )
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `serve` argument (repeatable)")
    p.add_argument(
        "--metrics-target",
        default=None,
        help="host:port of --target's metrics endpoint, to read its CPU time by thread kind (host cost)",
    )
    p.add_argument("--http-target", default=None, help="host:port of --target's HTTP API (host-rerank)")
    p.add_argument(
        "--target-pid",
        type=int,
        default=None,
        help="pid of --target's process on this machine: its CPU time by thread kind read from /proc, the "
        "Python threads told apart by py-spy (for a server without prefixscore_thread_cpu_seconds_total)",
    )
    p.add_argument(
        "--workload",
        type=_list(WORKLOADS, [w for w in WORKLOADS if w not in ("w5", "soak") and not w.startswith("w6")]),
        default=["w1-cold"],
        help=f"comma list of {','.join(WORKLOADS)}, or all (all but w5, which runs through a router: "
        "--target ROUTER --replica-metrics, w6, which needs a one-logit classifier: "
        "--model bench-cpu-reward, and soak, which runs alone for --duration) [w1-cold]",
    )
    p.add_argument(
        "--mode", type=_list(MODES), default=["prefix"], help=f"comma list of {','.join(MODES)}, or all [prefix]"
    )
    p.add_argument("--runs", type=int, default=3, help="timed requests per W1/W3 run set [%(default)s]")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole workload list this many times, one after another; shares are taken per "
        "round (W1-cold next to the traffic it is compared with) and their median printed [%(default)s]",
    )
    p.add_argument("--warmup-runs", type=int, default=1, help="untimed requests before timing [%(default)s]")
    p.add_argument(
        "--warmup-buckets", action="store_true", help="also compile every bucket first (engine.warmup), timed apart"
    )
    p.add_argument("--query-tokens", type=int, default=2000, help="W1 query length [%(default)s]")
    p.add_argument("--items", type=int, default=500, help="W1 items per request [%(default)s]")
    p.add_argument("--item-tokens", type=int, default=20, help="W1 item length [%(default)s]")
    p.add_argument(
        "--sequential-items",
        type=int,
        default=10,
        help="items per request in sequential mode (reported per item) [%(default)s]",
    )
    p.add_argument("--w2-requests", type=int, default=64, help="W2 requests [%(default)s]")
    p.add_argument("--concurrency", type=int, default=16, help="W2 and W3-grpc concurrent clients [%(default)s]")
    p.add_argument("--w2-max-query", type=int, default=3000, help="W2 longest query [%(default)s]")
    p.add_argument("--w2-max-items", type=int, default=1000, help="W2 most items per request [%(default)s]")
    p.add_argument("--w2-max-item-tokens", type=int, default=200, help="W2 longest item [%(default)s]")
    p.add_argument(
        "--duration",
        type=_seconds,
        default=600.0,
        help="soak: how long the traffic runs, e.g. 90s, 10m, 1h (bench/soak.py) [10m]",
    )
    p.add_argument("--window", type=_seconds, default=60.0, help="soak: the report interval [60s]")
    p.add_argument("--w3-docs", type=int, default=100, help="W3 documents per request [%(default)s]")
    p.add_argument("--w3-max-doc-tokens", type=int, default=300, help="W3 longest document [%(default)s]")
    p.add_argument("--w3-requests", type=int, default=64, help="W3-grpc requests [%(default)s]")
    p.add_argument("--w4-requests", type=int, default=256, help="W4 requests [%(default)s]")
    p.add_argument("--w4-concurrency", type=int, default=64, help="W4 concurrent clients [%(default)s]")
    p.add_argument("--w4-query-tokens", type=int, default=300, help="W4 query length [%(default)s]")
    p.add_argument("--w4-items", type=int, default=10, help="W4 items per request [%(default)s]")
    p.add_argument("--w4-item-tokens", type=int, default=20, help="W4 item length [%(default)s]")
    p.add_argument(
        "--host-requests", type=int, default=2000, help="requests of host and host-rerank (W4's clients) [%(default)s]"
    )
    p.add_argument("--rerank-docs", type=int, default=20, help="host-rerank documents per request [%(default)s]")
    p.add_argument("--w6-conversation", type=int, default=1000, help="W6 conversation tokens [%(default)s]")
    p.add_argument("--w6-responses", type=int, default=64, help="W6 candidate responses [%(default)s]")
    p.add_argument(
        "--w6-max-response-tokens", type=int, default=300, help="W6 longest response (from 50) [%(default)s]"
    )
    p.add_argument("--w5-queries", type=int, default=12, help="W5 W1-sized queries sent in chunks [%(default)s]")
    p.add_argument("--w5-chunk", type=int, default=25, help="W5 items per request of a chunked query [%(default)s]")
    p.add_argument(
        "--w5-hot-requests", type=int, default=24, help="W5 W2-shaped requests over W2's hot queries [%(default)s]"
    )
    p.add_argument(
        "--replica-metrics",
        type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
        default=[],
        help="comma list of host:port, the metrics endpoints of the replicas behind --target (a router): "
        "W5 reports each one's prefill tokens and prefix-cache hits",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after the workloads, trace one cold W1 request with jax.profiler into DIR and print where "
        "its time went (in process only)",
    )
    p.add_argument(
        "--collectives",
        action="store_true",
        help="after the workloads, print what the largest call moves between devices (from its compiled HLO) "
        "against its FLOPs, and the predicted all-reduce share on TPU v5e/v6e and H100 (in process only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="write the results (a list of records) here")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)


def _list(choices: Sequence[str], every: Sequence[str] | None = None) -> Callable[[str], list[str]]:
    """A comma list of `choices`; "all": `every` (default: all of them)."""

    def parse(text: str) -> list[str]:
        names = list(every or choices) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)} or all")
        return names

    return parse


def _seconds(text: str) -> float:
    """A duration: "90s", "10m", "1h" or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (90s, 10m, 1h)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive: {text!r}")
    return value


# ---- where requests go -------------------------------------------------------------------------
class InProcess:
    """The in-process Scorer (validation, prefix cache, engine), any mode."""

    kind = "in-process"

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer

    def score(self, req: wl.Request, mode: str) -> tuple[list[list[float]], int]:
        scores = self.scorer.score(req.query, req.items, req.labels, req.apply_softmax, mode=mode)
        return scores, self.scorer.last_usage.cached_tokens


class Remote:
    """A gRPC ScoreService (the server runs its prefix path)."""

    kind = "grpc"

    def __init__(self, target: str, prefix_key: bool = True) -> None:
        from prefixscore.client import ScoreClient

        self.target = target
        self.client = ScoreClient(target, send_prefix_key=prefix_key)

    def score(self, req: wl.Request, mode: str) -> tuple[list[list[float]], int]:
        result = self.client.score(req.query, req.items, label_token_ids=req.labels, apply_softmax=req.apply_softmax)
        return result.scores, result.usage.cached_tokens

    def close(self) -> None:
        self.client.close()


class RemoteRerank:
    """HTTP POST /v1/rerank, one keep-alive connection per client thread."""

    kind = "http"

    def __init__(self, target: str) -> None:
        self.target = target
        self._local = threading.local()

    def score(self, req: wl.RerankTexts, mode: str) -> tuple[list[float], int]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            host, port = self.target.rsplit(":", 1)
            conn = self._local.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        body = json.dumps({"query": req.query, "documents": req.items, "return_documents": False})
        conn.request("POST", "/v1/rerank", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"/v1/rerank answered {response.status}: {answer}")
        return [r["relevance_score"] for r in answer["results"]], answer["usage"]["cached_tokens"]


class RemoteClassify:
    """HTTP POST /v1/classify (W6): each request's conversation + response inputs in one body,
    whose shared leading tokens the server prefills once; one_by_one: each input in a body of
    its own, one after another (every one a whole sequence)."""

    kind = "http"

    def __init__(self, target: str, one_by_one: bool) -> None:
        self.target = target
        self.one_by_one = one_by_one
        self._local = threading.local()

    def _post(self, inputs: list[list[int]]) -> dict[str, Any]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            host, port = self.target.rsplit(":", 1)
            conn = self._local.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        conn.request("POST", "/v1/classify", json.dumps({"input": inputs}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"/v1/classify answered {response.status}: {answer}")
        return answer

    def score(self, req: wl.Request, mode: str) -> tuple[list[list[float]], int]:
        inputs = [req.query + item for item in req.items]
        answers = [self._post([one]) for one in inputs] if self.one_by_one else [self._post(inputs)]
        probs = [d["probs"] for a in answers for d in a["data"]]
        return probs, sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)


class ServedProcess:
    """`prefixscore serve` in a process of its own, on free ports, until closed: its threads
    are the server's alone, so their CPU time per request is the host cost."""

    def __init__(self, args: argparse.Namespace, timeout_s: float = 1800.0) -> None:
        port, http_port, metrics_port = free_ports(3)
        self.target, self.http_target = f"127.0.0.1:{port}", f"127.0.0.1:{http_port}"
        self.metrics_target = f"127.0.0.1:{metrics_port}"
        cmd = [sys.executable, "-c", "from prefixscore.cli import main; main()", "serve"]
        cmd += ["--model", args.model, "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--http-port", str(http_port), "--metrics-port", str(metrics_port), "--log-level", "warning"]
        if args.attention:
            cmd += ["--attention", args.attention]
        if args.compile_cache:
            cmd += ["--compile-cache", args.compile_cache]
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([*cmd, *args.serve_arg], stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_serving(timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_serving(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the served process exited {self.proc.returncode}:\n{self._tail()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"the served process was not SERVING after {timeout_s:.0f} s:\n{self._tail()}")

    def _tail(self, chars: int = 4000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM (a server drains and exits), SIGKILL if it has not after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warmed_up(client: Any, timeout_s: float = 1800.0) -> Any:
    """The target's GetModelInfo once its background warm-up is done: measuring while shapes
    still compile beside the traffic would count the compiler's CPU and waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.model_info()
        if info.call_shapes_ready >= info.call_shapes:
            return info
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the target compiled {info.call_shapes_ready} of {info.call_shapes} shapes in {timeout_s:.0f} s"
            )
        time.sleep(0.5)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def scrape(metrics_target: str) -> dict[str, float]:
    """A server's samples by name with labels ("name{k=v,...}"), from GET /metrics at `host:port`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_target}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def replica_counts(metrics_target: str) -> dict[str, float]:
    """What one replica behind a router did so far: query tokens prefilled, prefix-cache hits and
    misses (one per request), items scored."""
    m = scrape(metrics_target)
    return {
        "prefill_tokens": m.get("prefixscore_tokens_total{kind=prefix}", 0.0),
        "hits": m.get("prefixscore_prefix_cache_hits_total", 0.0),
        "misses": m.get("prefixscore_prefix_cache_misses_total", 0.0),
        "items": m.get("prefixscore_items_scored_total", 0.0),
    }


def thread_cpu(metrics_target: str) -> dict[str, float]:
    """The server's `prefixscore_thread_cpu_seconds_total` by kind (telemetry/host_cost.py)."""
    with urllib.request.urlopen(f"http://{metrics_target}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    prefix = 'prefixscore_thread_cpu_seconds_total{kind="'
    for line in text.splitlines():
        if line.startswith(prefix):
            kind, value = line[len(prefix) :].split('"} ')
            out[kind] = float(value)
    out["total"] = sum(out.values())
    return out


# ---- measurement ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    latencies: list[float] = dataclasses.field(default_factory=list)
    items: list[int] = dataclasses.field(default_factory=list)
    flops: list[int] = dataclasses.field(default_factory=list)
    peaks: list[float] = dataclasses.field(default_factory=list)  # matmul FLOP/s around each request
    hits: int = 0
    wall: float = 0.0  # of a concurrent run


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


class Peak:
    """The device's measured peak: a large square matmul, timed in this process.

    probe() times one matmul; best is the fastest seen. The bench probes between
    timed requests, so each request is compared with what the machine delivered
    around it (a shared machine's background load cancels out of the ratio).
    """

    def __init__(self, dtype: str, n: int | None = None) -> None:
        import jax
        import jax.numpy as jnp

        self.n = n or (2048 if jax.default_backend() == "cpu" else 8192)
        self.dtype = dtype
        self._a = jnp.ones((self.n, self.n), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
        self._f = jax.jit(lambda x: x @ x)
        self._f(self._a).block_until_ready()
        self.best = 0.0

    def probe(self) -> float:
        t = time.perf_counter()
        self._f(self._a).block_until_ready()
        rate = 2 * self.n**3 / (time.perf_counter() - t)
        self.best = max(self.best, rate)
        return rate

    def measure(self, repeats: int = 5) -> float:
        return max(self.probe() for _ in range(repeats))

    @property
    def name(self) -> str:
        return f"{self.n}x{self.n}x{self.n} {self.dtype} matmul"


def commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if rev.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cpus, {platform.system()} {platform.release()}"


class Progress:
    """A progress bar on stderr (tqdm when installed)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)
            except ImportError:
                print(f"{label}: {total} requests", file=sys.stderr)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- one workload x mode -----------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scorer: Any = None
        self.server: Any = None
        self.peak: Peak | None = None
        self.served: ServedProcess | None = None
        self.metrics_target, self.http_target = args.metrics_target, args.http_target
        if args.serve_process:
            self.served = ServedProcess(args)
            args.target = self.served.target
            self.metrics_target, self.http_target = self.served.metrics_target, self.served.http_target
        self.remote: Remote | None = Remote(args.target) if args.target else None
        if self.remote is None:
            from prefixscore.engine.scorer import Scorer
            from prefixscore.engine.build import EngineSpec, build_engine

            spec = EngineSpec(
                args.model,
                args.dtype,
                attn_impl=args.attention,
                devices=args.devices,
                tp_size=args.tp_size,
                dp_size=args.dp_size,
                compile_cache=args.compile_cache,
            )
            built = build_engine(spec)
            loaded = built.model
            self.scorer = Scorer(loaded, built.engine)
            self.cfg = loaded.cfg
            self.tokenizer = loaded.tokenizer
        else:
            from prefixscore.model import presets

            info = warmed_up(self.remote.client)
            self.model_info = info
            # FLOPs need the shapes: known for presets (a served directory reports no config)
            preset = presets.RANDOM_PRESETS.get(info.model)
            self.cfg = preset[0] if preset else None
            self.tokenizer = None
        self.sizes = wl.Sizes(
            w1_query=args.query_tokens,
            w1_items=args.items,
            w1_item_tokens=args.item_tokens,
            sequential_items=args.sequential_items,
            w2_requests=args.w2_requests,
            w2_concurrency=args.concurrency,
            **wl.w2_ranges(args.w2_max_query, args.w2_max_items, args.w2_max_item_tokens),
            w3_docs=args.w3_docs,
            w3_doc_tokens=(min(50, args.w3_max_doc_tokens), args.w3_max_doc_tokens),
            w3_requests=args.w3_requests,
            w4_requests=args.w4_requests,
            w4_concurrency=args.w4_concurrency,
            w4_query=args.w4_query_tokens,
            w4_items=args.w4_items,
            w4_item_tokens=args.w4_item_tokens,
            w6_conversation=args.w6_conversation,
            w6_responses=args.w6_responses,
            w6_response_tokens=(min(50, args.w6_max_response_tokens), args.w6_max_response_tokens),
        )

    @property
    def vocab(self) -> int:
        if self.cfg is not None:
            return self.cfg.vocab_size
        return int(self.model_info.vocab_size)

    def context(self) -> dict[str, Any]:
        """The configuration printed with every result."""
        import jax

        if self.scorer is not None:
            engine = self.scorer.engine
            return {
                "model": self.args.model,
                "dtype": self.args.dtype,
                "backend": jax.default_backend(),
                "device_kind": jax.devices()[0].device_kind,
                "devices": engine.n_devices,
                "tp_size": engine.layout.shape.model,
                "dp_size": engine.layout.shape.data,
                "attention": engine.attn_impl,
                "buckets": dataclasses.asdict(engine.buckets),
                "target": "in-process",
                "commit": commit(),
                "machine": machine(),
                "jax": jax.__version__,
            }
        info = self.model_info
        return {
            "model": info.model,
            "dtype": info.dtype,
            "backend": "remote",
            "device_kind": ", ".join(info.devices),
            "devices": len(info.devices),
            "attention": info.attention,
            "target": self.args.target,
            "commit": commit(),
            "machine": machine(),
        }

    @property
    def labels(self) -> list[int]:
        # a classifier takes no label ids: its head scores every label
        return [] if self.cfg is not None and self.cfg.num_labels else wl.label_ids(self.vocab, self.tokenizer)

    def requests(self, workload: str, n: int, gen: wl.Generator) -> list[wl.Request]:
        if workload.startswith("w6"):
            return wl.w6(gen, self.sizes, n)
        labels = self.labels
        if workload.startswith("w1"):
            return wl.w1(gen, self.sizes, labels, cold=workload == "w1-cold", runs=n)
        if workload == "w2":
            return wl.w2(gen, self.sizes, labels, n)
        if workload in ("w4", "host"):
            return wl.w4(gen, self.sizes, labels, n)
        if workload == "host-rerank":
            return wl.rerank_texts(gen, n, self.args.rerank_docs)  # type: ignore[return-value]
        if workload == "w5":  # n: W1-sized queries (and the W2-shaped hot requests)
            return wl.w5(gen, self.sizes, labels, n, self.args.w5_chunk, self.args.w5_hot_requests)
        return wl.w3(gen, self.sizes, labels, n)

    def concurrency(self, workload: str) -> int | None:
        """Clients at once for a concurrent workload; None: one request at a time."""
        return {
            "w2": self.sizes.w2_concurrency,
            "w3-grpc": self.sizes.w2_concurrency,
            "w4": self.sizes.w4_concurrency,
            "host": self.sizes.w4_concurrency,
            "host-rerank": self.sizes.w4_concurrency,
            "w5": self.sizes.w2_concurrency,
        }.get(workload)

    def flops(self, req: wl.Request, cached: int) -> int:
        """Model FLOPs of a request whose first `cached` query tokens came from the prefix cache."""
        if self.cfg is None or isinstance(req, wl.RerankTexts):  # text: its tokens are the server's
            return 0
        from prefixscore.model import flops

        lens = [len(it) for it in req.items]
        total = flops.request(self.cfg, len(req.query), lens, req.apply_softmax, len(req.labels))["total"]
        # A partial hit (W3's shared header) still prefills the rest of the query: take off only the
        # cached part's prefill, so a hit on 60 header tokens is not booked as a whole query saved.
        cached = min(cached, len(req.query))
        return total - flops.request(self.cfg, cached, [], req.apply_softmax, len(req.labels))["prefill"]

    def target(self, workload: str, mode: str = "prefix") -> InProcess | Remote | RemoteRerank | RemoteClassify:
        if workload == "w5":
            if self.args.target is None:
                raise SystemExit("w5 runs through a router in front of replicas: --target ROUTER --replica-metrics")
            return Remote(self.args.target, prefix_key=mode == "affinity")
        if workload == "host-rerank":
            if self.http_target is None and self.remote is None:
                self._local_server()
            if self.http_target is None:
                raise SystemExit("host-rerank needs an HTTP API: --serve-process, or --target with --http-target")
            return RemoteRerank(self.http_target)
        if workload == "w6" and mode != "prefix":  # the baselines: in process, as W1's
            return InProcess(self.scorer)
        if workload.startswith("w6"):
            if self.http_target is None and self.remote is None:
                self._local_server()
            if self.http_target is None:
                raise SystemExit("w6 needs an HTTP API: --serve-process, or --target with --http-target")
            return RemoteClassify(self.http_target, one_by_one=workload == "w6-one-by-one")
        if self.remote is not None:
            return self.remote
        if workload not in CONCURRENT:
            return InProcess(self.scorer)
        return self._local_server()

    def _local_server(self) -> Remote:
        """W2/W3-grpc/W4 (and host, host-rerank) without a target are measured through gRPC (and
        HTTP): this engine served on free ports in this process."""
        if self.server is None:
            from prefixscore.service.core import ServerConfig
            from prefixscore.service.process import ServerThread

            cfg = ServerConfig(
                host="127.0.0.1",
                port=0,
                metrics_port=None,
                http_port=0,
                warmup=False,
                loaded=self.scorer.model,
                engine=self.scorer.engine,
            )
            server = ServerThread(cfg).start()
            try:
                self.local_remote = Remote(server.target)
            except BaseException:
                server.stop()
                raise
            self.server = server
            self.http_target = f"127.0.0.1:{server.server.http_port}"
        return self.local_remote

    def host_cpu(self) -> dict[str, float] | None:
        """The server's CPU seconds so far by thread kind: from its pid (--target-pid) or its
        metrics endpoint; None when neither is known (a server in this process is not measured:
        the bench's client threads would count too)."""
        if self.args.target_pid:
            pid = self.args.target_pid
            return host_cost.seconds_by_kind(pid, host_cost.interpreter_thread_ids(pid))
        return thread_cpu(self.metrics_target) if self.metrics_target else None

    def one(self, workload: str, mode: str, gen: wl.Generator) -> dict[str, Any]:
        from prefixscore.telemetry.compiles import CompileCounter

        args = self.args
        target = self.target(workload, mode)
        workers = self.concurrency(workload)
        n_timed = {
            "w2": self.sizes.w2_requests,
            "w3-grpc": self.sizes.w3_requests,
            "w4": self.sizes.w4_requests,
            "host": args.host_requests,
            "host-rerank": args.host_requests,
        }.get(workload, args.runs)
        n_warm = max(args.warmup_runs, 1 if workload == "w1-warm" else 0)
        if workers:
            n_warm = min(n_warm * workers, n_timed)
        if workload == "w5":  # warm-up over queries of its own (the shapes compile; nothing timed is cached)
            warm, timed = self.requests(workload, 1, gen), self.requests(workload, args.w5_queries, gen)
        else:
            reqs = self.requests(workload, n_warm + n_timed, gen)
            if workload == "w1-warm":  # the warm-up request puts the (one) query in the prefix cache
                reqs = [reqs[0]] * n_warm + reqs[n_warm:]
            if mode == "sequential":
                k = self.sizes.sequential_items
                reqs = [dataclasses.replace(r, items=r.items[:k]) for r in reqs]
            warm, timed = reqs[:n_warm], reqs[n_warm:]
        compiles, compile_s, started = CompileCounter.count(), CompileCounter.seconds(), time.perf_counter()
        if workers:
            # Concurrently, by as many clients as the timed run: the server batches concurrent requests
            # together, and only concurrent warm-up compiles the batch shapes the timed run will meet.
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda r: target.score(r, mode), warm))
        else:
            for r in warm:
                target.score(r, mode)
        warmup = {
            "seconds": time.perf_counter() - started,
            "compilations": CompileCounter.count() - compiles,
            "compile_seconds": CompileCounter.seconds() - compile_s,
        }
        stats0 = dict(self.scorer.engine.stats) if self.scorer is not None else None
        compiles = CompileCounter.count()
        # the server's CPU time by thread kind around the timed run: when it runs in a process of
        # its own (in this one, the bench's client threads would count too)
        cpu0 = self.host_cpu() if workers else None
        replicas0 = [replica_counts(m) for m in args.replica_metrics] if workload == "w5" else []
        timing = self._timed(target, workload, mode, timed, workers)
        cpu1 = self.host_cpu() if cpu0 is not None else None
        record = self._record(workload, mode, timed, timing, warmup, stats0, CompileCounter.count() - compiles)
        if workload == "w5":
            target.close()  # type: ignore[union-attr]
            record["ideal_hit_rate"] = wl.ideal_hit_rate(timed)
            record["ideal_prefill_tokens"] = wl.ideal_prefill_tokens(timed)
            record["replicas"] = [
                {"metrics": m, **{k: after[k] - before[k] for k in after}}
                for m, before, after in zip(
                    args.replica_metrics, replicas0, [replica_counts(m) for m in args.replica_metrics], strict=True
                )
            ]
        if cpu0 is not None and cpu1 is not None:
            record["host_cpu_ms_per_request"] = host_cost.per_request(cpu0, cpu1, len(timed))
        record["transport"] = target.kind if isinstance(target, InProcess) else f"{target.kind} {target.target}"
        record["concurrency"] = workers or 1
        return record

    def _timed(self, target, workload: str, mode: str, reqs: list[wl.Request], workers: int | None) -> Timing:
        timing = Timing()
        progress = Progress(len(reqs), f"{workload}/{mode}", self.args.progress)

        def send(r: wl.Request) -> tuple[float, int, int]:
            t = time.perf_counter()
            scores, cached = target.score(r, mode)
            elapsed = time.perf_counter() - t
            assert len(scores) == len(r.items)
            progress.update()
            return elapsed, cached, self.flops(r, cached)

        if workers:
            # the machine's matmul rate right before and after the run: a shared machine's speed
            # drifts between runs, and the utilisation share cancels that drift out
            before = self.peak.probe() if self.peak else 0.0
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(send, reqs))
            timing.wall = time.perf_counter() - started
            timing.peaks.append(max(before, self.peak.probe() if self.peak else 0.0))
        else:
            results = []
            started = time.perf_counter()
            before = self.peak.probe() if self.peak else 0.0
            for r in reqs:
                results.append(send(r))
                after = self.peak.probe() if self.peak else 0.0
                timing.peaks.append(max(before, after))
                before = after
            timing.wall = time.perf_counter() - started
        progress.close()
        for r, (elapsed, cached, fl) in zip(reqs, results, strict=True):
            timing.latencies.append(elapsed)
            timing.items.append(len(r.items))
            timing.flops.append(fl)
            timing.hits += cached > 0
        return timing

    def _record(self, workload, mode, reqs, timing: Timing, warmup, stats0, steady_compiles) -> dict[str, Any]:
        utilisation = None
        requests_per_s = None
        if workload in CONCURRENT:  # one concurrent run: totals over its wall time
            items_per_s = sum(timing.items) / timing.wall
            requests_per_s = len(timing.items) / timing.wall
            flops_per_s = sum(timing.flops) / timing.wall
            if timing.peaks and all(timing.peaks) and self.cfg is not None:
                utilisation = flops_per_s / timing.peaks[0]
        else:  # one request per run: the median run
            items_per_s = statistics.median(n / t for n, t in zip(timing.items, timing.latencies, strict=True))
            rates = [f / t for f, t in zip(timing.flops, timing.latencies, strict=True)]
            flops_per_s = statistics.median(rates)
            if timing.peaks and all(timing.peaks) and self.cfg is not None:
                utilisation = statistics.median(r / p for r, p in zip(rates, timing.peaks, strict=True))
        padding = None
        if stats0 is not None and mode != "packed":
            s1 = self.scorer.engine.stats
            device = s1["device_tokens"] - stats0["device_tokens"]
            padding = 1 - (s1["tokens"] - stats0["tokens"]) / device if device else None
        ms = [t * 1000 for t in timing.latencies]
        return {
            "workload": workload,
            "mode": mode,
            **self.context(),
            "requests": len(reqs),
            "items": sum(timing.items),
            "items_per_request": statistics.mean(timing.items),
            "items_per_s": items_per_s,
            "requests_per_s": requests_per_s,
            "latency_ms": {"p50": percentile(ms, 50), "p95": percentile(ms, 95), "p99": percentile(ms, 99)},
            "warmup": warmup,
            "compile_seconds": warmup["compile_seconds"],
            "steady_state_compilations": steady_compiles,
            "padding_share": padding,
            "prefix_cache_hit_rate": timing.hits / len(reqs) if reqs else None,
            "flops_per_request": statistics.mean(timing.flops) if timing.flops else None,
            "achieved_flops_per_s": flops_per_s if self.cfg is not None else None,
            "utilisation": utilisation,
            "peaks_around_requests": timing.peaks,
            "sizes": dataclasses.asdict(self.sizes),
        }

    def profile(self, log_dir: Path, gen: wl.Generator) -> dict[str, Any]:
        """Trace one W1 request over a new query (prefill included) after its shapes have
        compiled; returns bench/profile.py's summary, also written to log_dir/summary.json
        (with the compiled HLO the summary maps kernels through)."""
        import jax

        from prefixscore.bench import profile

        target = InProcess(self.scorer)
        warm, cold = self.requests("w1-cold", 2, gen)
        target.score(warm, "prefix")  # compiles what the traced request needs, if no run did
        with jax.profiler.trace(str(log_dir)):
            started = time.perf_counter()
            target.score(cold, "prefix")
            wall = time.perf_counter() - started
        hlo = self.scorer.engine.hlo_texts()
        summary = profile.summarize(profile.latest_xplane(log_dir), hlo, wall)
        (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (log_dir / "executables.hlo.txt").write_text("\n".join(hlo))  # to summarize the trace again elsewhere
        return summary

    def close(self) -> None:
        if self.server is not None:
            self.local_remote.close()
            self.server.stop()
        if self.remote is not None:
            self.remote.close()
        if self.served is not None:
            self.served.close()


def table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'workload':<9} {'mode':<10} {'items/s':>9} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} "
        f"{'GFLOP/s':>8} {'util':>6} {'compile s':>9} {'pad %':>6} {'hit %':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        lat = r["latency_ms"]
        gf = r["achieved_flops_per_s"]
        util = r.get("utilisation")
        pad, hit = r["padding_share"], r["prefix_cache_hit_rate"]
        lines.append(
            f"{r['workload']:<9} {r['mode']:<10} {r['items_per_s']:>9.1f} {lat['p50']:>9.1f} {lat['p95']:>9.1f} "
            f"{lat['p99']:>9.1f} {(gf or 0) / 1e9:>8.1f} {(util or 0) * 100:>5.1f}% {r['compile_seconds']:>9.2f} "
            f"{'-' if pad is None else f'{pad * 100:.1f}':>6} {'-' if hit is None else f'{hit * 100:.0f}':>6}"
        )
    return "\n".join(lines)


def replica_table(records: list[dict[str, Any]]) -> str:
    """W5: the hit rate against one cache's ideal, and the query tokens each replica prefilled."""
    rows = [r for r in records if r.get("replicas")]
    if not rows:
        return ""
    n = len(rows[0]["replicas"])
    head = f"{'workload':<9} {'mode':<9} {'hit %':>6} {'ideal %':>7} {'prefill tokens':>14}  per replica ({n})"
    lines = [head, "-" * len(head)]
    for r in rows:
        per = [int(x["prefill_tokens"]) for x in r["replicas"]]
        lines.append(
            f"{r['workload']:<9} {r['mode']:<9} {r['prefix_cache_hit_rate'] * 100:>6.1f} "
            f"{r['ideal_hit_rate'] * 100:>7.1f} {sum(per):>14,}  {', '.join(f'{x:,}' for x in per)}"
        )
    base = {r["round"]: r for r in rows if r["mode"] == "no-key"}
    for r in rows:
        other = base.get(r["round"])
        if r["mode"] == "affinity" and other is not None:
            mine, theirs = (sum(x["prefill_tokens"] for x in rr["replicas"]) for rr in (r, other))
            if theirs:
                lines.append(f"affinity prefilled {mine / theirs:.2f} of the query tokens no key did")
    return "\n".join(lines)


def host_table(records: list[dict[str, Any]]) -> str:
    """The server's CPU time per request by thread kind (records that measured it)."""
    rows = [r for r in records if r.get("host_cpu_ms_per_request")]
    if not rows:
        return ""
    kinds = f"{'python':>7} {'xla':>7} {'grpc':>6} {'other':>6} {'total':>7}"
    head = f"{'workload':<12} {'req/s':>8}  host CPU ms per request: {kinds}"
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r["host_cpu_ms_per_request"]
        lines.append(
            f"{r['workload']:<12} {r['requests_per_s']:>8.1f}  {'':>24}{c['python']:>7.2f} {c['xla']:>7.2f} "
            f"{c['grpc']:>6.2f} {c['other']:>6.2f} {c['total']:>7.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the selected workloads and modes; print the table; write --json."""
    if "soak" in args.workload:
        if args.workload != ["soak"]:
            raise SystemExit("soak runs alone: --workload soak")
        from prefixscore.bench import soak

        return soak.run(args)
    bench = Bench(args)
    records: list[dict[str, Any]] = []
    bucket_warmup = profiled = moved = None
    try:
        in_process = bench.scorer is not None
        if in_process:
            bench.peak = Peak(args.dtype)
            bench.peak.measure()
        if args.warmup_buckets and in_process:
            bucket_warmup = bench.scorer.engine.warmup()
            print(f"engine.warmup: {bucket_warmup}", file=sys.stderr)
        gen = wl.Generator(bench.vocab, args.seed)
        for round_ in range(args.rounds):
            for workload in args.workload:
                one_mode = workload in CONCURRENT or workload == "w6-one-by-one" or not in_process
                modes = ["prefix"] if one_mode else args.mode
                if workload == "w5":
                    modes = list(W5_MODES)
                for mode in modes:
                    records.append({**bench.one(workload, mode, gen), "round": round_})
        if bench.peak:
            bench.peak.measure()
        if args.profile and in_process:
            profiled = bench.profile(Path(args.profile), gen)
        if args.collectives and in_process:
            from prefixscore.bench.collectives import traffic

            engine = bench.scorer.engine
            moved = traffic(engine, max(engine.executable_keys()))  # the largest call
    finally:
        bench.close()
    peak = bench.peak
    for r in records:
        r["bucket_warmup"] = bucket_warmup
        if peak and r["achieved_flops_per_s"]:
            r["peak"] = peak.name
            r["peak_flops_per_s"] = peak.best
            r["utilisation_vs_best_peak"] = r["achieved_flops_per_s"] / peak.best
            if r["utilisation"] is None:
                r["utilisation"] = r["utilisation_vs_best_peak"]
    for round_ in range(args.rounds):  # a round's records against that round's baselines
        _ratios([r for r in records if r["round"] == round_])
        _shares([r for r in records if r["round"] == round_])
    ctx = records[0] if records else {}
    print(
        f"model {ctx.get('model')} {ctx.get('dtype')} | {ctx.get('backend')} x{ctx.get('devices')} "
        f"({ctx.get('device_kind', '')}) | attention {ctx.get('attention')} | commit {ctx.get('commit')}"
    )
    if peak:
        print(f"peak: {peak.best / 1e9:.1f} GFLOP/s (best {peak.name}); util: vs the matmul timed around each request")
    print(table(records))
    if host_table(records):
        print(host_table(records))
    if replica_table(records):
        print(replica_table(records))
    for r in records:
        if r.get("speedup"):
            print(f"{r['workload']} prefix vs {', '.join(f'{m} {x:.1f}x' for m, x in r['speedup'].items())}")
    shares = share_lines(records) + median_lines(records)
    if shares:
        print("\n".join(shares))
    if profiled:
        from prefixscore.bench.profile import format_summary

        print(format_summary(profiled))
    if moved:
        from prefixscore.bench.collectives import format_traffic

        print(format_traffic(moved))
        for r in records:
            r["collectives"] = moved
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(records, indent=2, default=str))
    return 0


def _ratios(records: list[dict[str, Any]]) -> None:
    """prefix items/s over each baseline's, per workload (the seeds report 10.1x packed, 50.9x sequential)."""
    by = {(r["workload"], r["mode"]): r for r in records}
    for (workload, mode), r in by.items():
        if mode != "prefix":
            continue
        r["speedup"] = {
            m: r["items_per_s"] / by[(workload, m)]["items_per_s"]
            for m in ("packed", "sequential")
            if (workload, m) in by
        }


def _shares(records: list[dict[str, Any]]) -> None:
    """Each W2/W3/W3-grpc/W4 record's model FLOP rate over W1-cold's (prefix) in the same run.

    Same run, same process and device, so the ratio cancels out what the machine can do and
    says only how much of the ideal request's rate the service keeps on that traffic. No
    W1-cold prefix record, or no FLOP rate (a remote model of unknown shape): no share.
    """
    base = next((r for r in records if r["workload"] == "w1-cold" and r["mode"] == "prefix"), None)
    base_rate = base and base.get("achieved_flops_per_s")
    if not base_rate:
        return
    base_util = base.get("utilisation")
    for r in records:
        rate = r.get("achieved_flops_per_s")
        if r["workload"] in SHARED_WITH_W1_COLD and rate is not None:
            r[SHARE_KEY] = rate / base_rate
            if base_util and r.get("utilisation"):
                r[UTIL_SHARE_KEY] = r["utilisation"] / base_util


def median_lines(records: list[dict[str, Any]]) -> list[str]:
    """With several rounds: per workload, the median items/s and (against W1-cold) the median share.

    On a shared machine the speed drifts between the minutes of one run; a share taken per
    round compares W1-cold with the traffic measured right after it, and the median over
    rounds is what one figure can say."""
    rounds = {r.get("round", 0) for r in records}
    if len(rounds) < 2:
        return []
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in records if r["mode"] == "prefix"):
        mine = [r for r in records if r["workload"] == workload and r["mode"] == "prefix"]
        rates = [r["items_per_s"] for r in mine]
        line = f"{workload} over {len(mine)} rounds: median {statistics.median(rates):.1f} items/s"
        line += f" ({', '.join(f'{x:.0f}' for x in rates)})"
        shares = [r[SHARE_KEY] for r in mine if SHARE_KEY in r]
        if shares:
            line += f"; median share of W1-cold's model FLOP rate {statistics.median(shares):.2f}"
            line += f" ({', '.join(f'{x:.2f}' for x in shares)})"
        utils = [r[UTIL_SHARE_KEY] for r in mine if UTIL_SHARE_KEY in r]
        if utils:
            line += f", {statistics.median(utils):.2f} against the matmul rate around each"
        lines.append(line)
    return lines


def share_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per prefix-mode record with a share ("W2 0.83 of W1-cold's model FLOP rate ...")."""
    lines = []
    for r in records:
        if SHARE_KEY not in r or r["mode"] != "prefix":  # the baselines' shares stay in the JSON only
            continue
        name = r["workload"].upper().replace("-GRPC", "-grpc")
        if "round" in r and any(x.get("round", 0) for x in records):
            name += f" (round {r['round'] + 1})"
        n = r.get("concurrency", 1)
        how = "in-process" if r.get("transport") == InProcess.kind else f"gRPC, {n} client{'s' * (n != 1)}"
        against = f"; {r[UTIL_SHARE_KEY]:.2f} against the matmul rate around each" if UTIL_SHARE_KEY in r else ""
        lines.append(
            f"{name} {r[SHARE_KEY]:.2f} of W1-cold's model FLOP rate "
            f"({r['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s, {how}{against})"
        )
    return lines
