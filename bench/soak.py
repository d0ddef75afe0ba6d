"""`prefixscore bench --workload soak --duration 1h`: W2-mixed traffic against one server for a
long time, reported per window; the run fails when anything grows past its noise.

Traffic: --concurrency clients, each sending one action after another, drawn at random:
W2 unary requests (new and hot queries), streams (open, a few batches, close), cancels (a
unary request or a stream cancelled by its client mid-flight), deadlines too short to meet, and
bad inputs (a token id outside the vocabulary, an empty item, more items than the server's
limit, a query past its context), each of which must be answered INVALID_ARGUMENT. Every
outcome is counted by gRPC status code; a code its action may not end with (INTERNAL or UNKNOWN
above all) fails the soak, and so does an INTERNAL or UNKNOWN in the server's own counters.

Per window (--window): the server's resident memory, pinned prefixes, pool pages held by
queries in use, queue depth, open streams and RPCs in flight (means of a scrape every few
seconds, with maxima), the p50/p99 latency of the window's successful unary requests, and the
outcomes by code.

The verdict (`judge`, `verdict`): past the first window (compilation, caches filling), each
series in TOLERANCES gets a least-squares line over the windows; its growth over the run (slope
x (windows - 1)) must stay within the series' tolerance (an absolute part plus a share of its
median level) plus 3 standard deviations of the points around the line (the noise). Besides:
no unexpected code in any window, successful unary requests in every judged window (no
stall), at least 3 judged windows, and once the traffic stops, pinned prefixes, open streams,
RPCs in flight, queue depth, queued and running requests all back to 0 within DRAIN_S.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from prefixscore.bench import workloads as wl
from prefixscore.bench.metrics import scrape
from prefixscore.bench.session import Bench
from prefixscore.bench.timing import percentile

WARMUP_WINDOWS = 1  # the first window compiles call shapes and fills the prefix cache: not judged
MIN_JUDGED_WINDOWS = 3  # fewer points than this make no line
NOISE_SIGMAS = 3.0
DRAIN_S = 30.0  # after the traffic stops, how long the server has to settle to zero
UNARY_TIMEOUT_S = 120.0  # far past any answer: an RPC that takes this long is a hang, counted as its code

# the mix of actions each client draws from (weights)
ACTIONS = {"unary": 0.6, "stream": 0.15, "cancel": 0.1, "deadline": 0.08, "bad": 0.07}
BAD_INPUTS = ("bad-token", "bad-empty-item", "bad-too-many-items", "bad-query-too-long")
# the codes each action may end with; RESOURCE_EXHAUSTED is admission control's fair answer to load
ALLOWED: dict[str, set[str]] = {
    "unary": {"OK", "RESOURCE_EXHAUSTED"},
    "stream": {"OK", "RESOURCE_EXHAUSTED"},
    "cancel-unary": {"CANCELLED", "OK"},  # OK: answered before the cancel reached it
    "cancel-stream": {"CANCELLED", "RESOURCE_EXHAUSTED"},
    "deadline": {"DEADLINE_EXCEEDED", "OK"},  # OK: answered within the deadline
    **{bad: {"INVALID_ARGUMENT"} for bad in BAD_INPUTS},
}
SERVER_FAILURES = ("INTERNAL", "UNKNOWN")  # codes the server must never have answered

# the server's gauges sampled in each window (name in the report -> metric)
GAUGES = {
    "pinned": "prefixscore_prefix_cache_pinned",
    "queue_depth": "prefixscore_queue_depth",
    "open_streams": "prefixscore_open_streams",
    "inflight": "prefixscore_inflight_requests",
}
# what must be back to zero once the traffic has stopped
SETTLED = (
    *GAUGES.values(),
    "prefixscore_queued_requests",
    "prefixscore_running_requests",
)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Growth over the run a series may show: `absolute` plus `relative` x its median level."""

    absolute: float
    relative: float


# series judged for an upward trend, and how much growth each may show besides its noise
TOLERANCES = {
    "rss_mib": Tolerance(16.0, 0.02),  # allocators and caches settle in steps of a few MiB
    # gauges of the work in progress: they follow the load, a leak keeps adding (and shows at the
    # end too, when they must be back to zero)
    "pinned": Tolerance(2.0, 0.25),
    "pool_pages_used": Tolerance(4.0, 0.25),
    "queue_depth": Tolerance(8.0, 0.50),
    "latency_p99_ms": Tolerance(50.0, 0.50),  # a shared machine's latency tail moves a lot
}


# ---- the trend judgement ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Trend:
    metric: str
    windows: int  # points the line was fitted to
    slope: float  # per window
    growth: float  # slope x (windows - 1): what the line adds from the first judged window to the last
    noise: float  # standard deviation of the points around the line
    allowance: float  # tolerance + NOISE_SIGMAS x noise
    passed: bool


def trend(metric: str, values: list[float], tolerance: Tolerance) -> Trend:
    """Least-squares line through `values` (one per window): passes when its growth over them is
    within `tolerance` of their median level plus NOISE_SIGMAS x the scatter around the line."""
    y = np.asarray(values, dtype=float)
    x = np.arange(len(y), dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    # ddof 2: two parameters fitted; with exactly two points there is no scatter to measure
    noise = float(np.std(y - (slope * x + intercept), ddof=2)) if len(y) > 2 else 0.0
    growth = float(slope) * (len(y) - 1)
    allowance = tolerance.absolute + tolerance.relative * abs(statistics.median(values)) + NOISE_SIGMAS * noise
    return Trend(metric, len(y), float(slope), growth, noise, allowance, growth <= allowance)


def judge(windows: list[dict[str, Any]], warmup: int = WARMUP_WINDOWS) -> list[Trend]:
    """A Trend for each series of TOLERANCES with at least MIN_JUDGED_WINDOWS values past the
    warm-up (RSS is unknown against a remote server without --target-pid; p99 of a window
    without a successful request is None)."""
    out = []
    for metric, tolerance in TOLERANCES.items():
        values = [w[metric] for w in windows[warmup:] if w.get(metric) is not None]
        if len(values) >= MIN_JUDGED_WINDOWS:
            out.append(trend(metric, values, tolerance))
    return out


def verdict(windows: list[dict[str, Any]], trends: list[Trend], unsettled: dict[str, float]) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    failures = []
    judged = windows[WARMUP_WINDOWS:]
    if len(judged) < MIN_JUDGED_WINDOWS:
        failures.append(
            f"{len(judged)} windows past the warm-up; a trend needs {MIN_JUDGED_WINDOWS}: a longer --duration"
        )
    for t in trends:
        if not t.passed:
            failures.append(f"{t.metric} grows {t.growth:+.2f} over {t.windows} windows (allowed {t.allowance:.2f})")
    for w in windows:
        for what, n in w["unexpected"].items():
            failures.append(f"window {w['window']}: {n} x {what}")
        for code in SERVER_FAILURES:
            if w["server_codes"].get(code):
                failures.append(f"window {w['window']}: the server answered {w['server_codes'][code]} x {code}")
    for w in judged:
        if not w["requests"]:
            failures.append(f"window {w['window']}: no unary request succeeded (a stall)")
    if unsettled:
        failures.append(f"not back to zero {DRAIN_S:.0f} s after the traffic stopped: {unsettled}")
    return failures


# ---- traffic ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What the bad inputs need to know of the server (from GetModelInfo)."""

    vocab: int
    max_items: int
    context: int


class Tally:
    """Outcomes of the window in progress, added to by every client thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._codes: collections.Counter[str] = collections.Counter()
        self._unexpected: collections.Counter[str] = collections.Counter()
        self._latencies: list[float] = []

    def add(self, action: str, code: str, latency_s: float | None = None) -> None:
        with self._lock:
            self._codes[code] += 1
            if code not in ALLOWED[action]:
                self._unexpected[f"{action} {code}"] += 1
            if latency_s is not None:
                self._latencies.append(latency_s)

    def take(self) -> tuple[dict[str, int], dict[str, int], list[float]]:
        """The window's codes, unexpected outcomes and unary latencies; starts the next window."""
        with self._lock:
            out = dict(self._codes), dict(self._unexpected), self._latencies
            self._codes, self._unexpected, self._latencies = collections.Counter(), collections.Counter(), []
        return out


class Traffic:
    """`clients` threads sending the soak's actions to `target` until stop()."""

    def __init__(
        self, target: str, clients: int, sizes: wl.Sizes, labels: list[int], limits: ServerLimits, seed: int
    ) -> None:
        self.target, self.sizes, self.labels, self.limits, self.seed = target, sizes, labels, limits, seed
        self.hot = wl.hot_queries(wl.Generator(limits.vocab, seed), sizes)  # shared by every client
        self.tally = Tally()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), name=f"soak-{k}") for k in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop drawing actions; returns once every client's last action has ended."""
        self._stop.set()
        for t in self._threads:
            t.join()

    def _client(self, k: int) -> None:
        from prefixscore.client import ScoreClient
        from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

        gen = wl.Generator(self.limits.vocab, self.seed + 1 + k)
        names, weights = list(ACTIONS), np.asarray(list(ACTIONS.values()))
        odds = weights / weights.sum()
        # the client for unary calls and streams; a stub of its own for calls cancelled mid-flight
        with ScoreClient(self.target) as client, grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.ScoreServiceStub(channel)
            while not self._stop.is_set():
                action = names[int(gen.rng.choice(len(names), p=odds))]
                if action == "cancel":
                    action = "cancel-unary" if gen.rng.random() < 0.5 else "cancel-stream"
                elif action == "bad":
                    action = BAD_INPUTS[int(gen.rng.integers(len(BAD_INPUTS)))]
                try:
                    code, latency = self._act(action, gen, client, stub)
                except grpc.RpcError as err:
                    code, latency = err.code().name, None
                except Exception as err:  # counted (and failing the soak), not fatal to the client
                    code, latency = f"{type(err).__name__}: {err}"[:120], None
                self.tally.add(action, code, latency)

    def _act(self, action: str, gen: wl.Generator, client: Any, stub: Any) -> tuple[str, float | None]:
        """One action: its status code name and, for a successful unary request, its latency."""
        from prefixscore.client.score_client import score_request

        req = wl.w2_request(gen, self.sizes, self.labels, self.hot)
        if action == "unary":
            started = time.perf_counter()
            client.score(req.query, req.items, label_token_ids=req.labels, timeout=UNARY_TIMEOUT_S)
            return "OK", time.perf_counter() - started
        if action == "deadline":
            client.score(req.query, req.items, label_token_ids=req.labels, timeout=gen.rng.uniform(0.001, 0.01))
            return "OK", None
        if action == "cancel-unary":
            call = stub.Score.future(score_request(req.query, req.items, req.labels), timeout=UNARY_TIMEOUT_S)
            time.sleep(gen.rng.uniform(0.0, 0.02))
            call.cancel()
            return call.code().name, None
        if action in ("stream", "cancel-stream"):
            return self._stream(action, gen, client, req), None
        return self._bad(action, gen, client, req), None

    def _stream(self, action: str, gen: wl.Generator, client: Any, req: wl.Request) -> str:
        """Open a stream over the request's query, send its items in a few batches; close it, or
        (cancel-stream) cancel it with the batches in flight."""
        from prefixscore.client.score_client import BatchRefused

        n = min(len(req.items), int(gen.rng.integers(2, 5)))
        batches = [list(b) for b in np.array_split(np.arange(len(req.items)), n)]
        session = client.stream(req.query, req.labels, timeout=UNARY_TIMEOUT_S)
        try:
            ids = [session.submit([req.items[j] for j in batch]) for batch in batches]
            if action == "cancel-stream":
                time.sleep(gen.rng.uniform(0.0, 0.02))
                session.cancel()
                return "CANCELLED"
            for batch_id in ids:
                session.result(batch_id)
            session.close()
            return "OK"
        except BatchRefused as refused:
            session.cancel()
            return refused.code.name
        except BaseException:
            session.cancel()
            raise

    def _bad(self, action: str, gen: wl.Generator, client: Any, req: wl.Request) -> str:
        """A request no server may score; its code (INVALID_ARGUMENT, each one)."""
        query, items = req.query, req.items
        if action == "bad-token":
            query = [*query[:-1], self.limits.vocab]
        elif action == "bad-empty-item":
            items = [*items, []]
        elif action == "bad-too-many-items":
            items = [[1]] * (self.limits.max_items + 1)
        else:
            query = gen.tokens(self.limits.context + 1)
        client.score(query, items, label_token_ids=req.labels, timeout=UNARY_TIMEOUT_S)
        return "OK"


# ---- the server's side --------------------------------------------------------------------------
class Probe:
    """The server's gauges, status counters and resident memory (from /proc when its pid is known)."""

    def __init__(self, metrics_target: str, pid: int | None) -> None:
        self.metrics_target, self.pid = metrics_target, pid

    def rss_mib(self) -> float | None:
        if self.pid is None:
            return None
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return None

    def gauges(self) -> dict[str, float]:
        """One scrape: GAUGES, pool pages in use (its usage ratio x its pages) and RSS."""
        m = scrape(self.metrics_target)
        out = {name: m.get(metric, 0.0) for name, metric in GAUGES.items()}
        pages = next((float(k.split("num_gpu_blocks=")[1].rstrip("}")) for k in m if "num_gpu_blocks=" in k), 0.0)
        out["pool_pages_used"] = m.get("prefixscore_prefix_pool_usage_ratio", 0.0) * pages
        rss = self.rss_mib()
        if rss is not None:
            out["rss_mib"] = rss
        return out

    def codes(self) -> collections.Counter[str]:
        """RPCs the server finished so far, by status code (all methods)."""
        out: collections.Counter[str] = collections.Counter()
        for key, value in scrape(self.metrics_target).items():
            if key.startswith("prefixscore_requests_total{"):
                code = key.split("code=")[1].split(",")[0].rstrip("}")
                out[code] += int(value)
        return out

    def unsettled(self, timeout_s: float = DRAIN_S) -> dict[str, float]:
        """Wait (bounded) for SETTLED to be all zero; returns those that are not (empty: settled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = scrape(self.metrics_target)
            left = {name: m.get(name, 0.0) for name in SETTLED if m.get(name, 0.0)}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)


# ---- the run ------------------------------------------------------------------------------------
def window_record(index: int, end_s: float, samples: list[dict[str, float]], tally: Tally, server: dict) -> dict:
    """One window's report from its scrapes, its outcomes and the server's codes over it."""
    codes, unexpected, latencies = tally.take()
    ms = [t * 1000 for t in latencies]
    record: dict[str, Any] = {"window": index, "end_s": round(end_s, 1)}
    for name in [*GAUGES, "pool_pages_used", "rss_mib"]:
        values = [s[name] for s in samples if name in s]
        record[name] = statistics.mean(values) if values else None
        record[f"{name}_max"] = max(values) if values else None
    record.update(
        requests=len(ms),
        latency_p50_ms=percentile(ms, 50) if ms else None,
        latency_p99_ms=percentile(ms, 99) if ms else None,
        codes=codes,
        unexpected=unexpected,
        server_codes=server,
    )
    return record


HEAD = (
    f"{'win':>4} {'end s':>7} {'RSS MiB':>8} {'pinned':>7} {'pages':>7} {'queue':>7} {'streams':>7} "
    f"{'inflight':>8} {'req':>5} {'p50 ms':>7} {'p99 ms':>8}  codes"
)


def row(w: dict[str, Any]) -> str:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    codes = " ".join(f"{code}:{n}" for code, n in sorted(w["codes"].items()))
    return (
        f"{w['window']:>4} {w['end_s']:>7.0f} {num(w['rss_mib'], '.1f'):>8} {w['pinned']:>7.2f} "
        f"{w['pool_pages_used']:>7.1f} {w['queue_depth']:>7.1f} {w['open_streams']:>7.2f} {w['inflight']:>8.2f} "
        f"{w['requests']:>5} {num(w['latency_p50_ms'], '.1f'):>7} {num(w['latency_p99_ms'], '.1f'):>8}  {codes}"
    )


def soak(
    traffic: Traffic, probe: Probe, duration_s: float, window_s: float, emit: Callable[[str], None] = print
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Run the traffic for duration_s, one report per window (emitted as each closes); then stop
    it and wait for the server to settle. Returns the windows and what did not settle."""
    sample_s = min(2.0, window_s / 5)
    windows: list[dict[str, Any]] = []
    codes0 = probe.codes()
    emit(HEAD)
    started = time.monotonic()
    traffic.start()
    try:
        for k in range(math.ceil(duration_s / window_s)):
            end = started + min((k + 1) * window_s, duration_s)
            samples = []
            while True:
                samples.append(probe.gauges())
                left = end - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(sample_s, left))
            codes1 = probe.codes()
            server = {code: n - codes0.get(code, 0) for code, n in codes1.items() if n - codes0.get(code, 0)}
            codes0 = codes1
            windows.append(window_record(k + 1, time.monotonic() - started, samples, traffic.tally, server))
            emit(row(windows[-1]))
    finally:
        traffic.stop()
    return windows, probe.unsettled()


def report(trends: list[Trend], unsettled: dict[str, float], failures: list[str]) -> str:
    lines = [f"trends past window {WARMUP_WINDOWS} (growth: slope x (windows - 1); allowed: tolerance + 3 sigma):"]
    for t in trends:
        lines.append(
            f"  {t.metric:<16} slope {t.slope:+10.3f}/window  growth {t.growth:+10.2f}  "
            f"allowed {t.allowance:9.2f}  noise {t.noise:8.2f}  {'ok' if t.passed else 'GROWING'}"
        )
    lines.append(f"after the traffic: {'all back to 0' if not unsettled else unsettled}")
    lines.append("verdict: PASS" if not failures else "verdict: FAIL\n  " + "\n  ".join(failures))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`bench --workload soak`: against --target (with --metrics-target), --serve-process, or the
    bench's engine served in this process with a metrics endpoint (RSS then is this process's:
    server and clients together, a leak in either shows). Exits 1 when the verdict fails."""
    from prefixscore.client import ScoreClient

    bench = Bench(args)
    server = None
    try:
        if bench.remote is None:
            from prefixscore.service.core import ServerConfig
            from prefixscore.service.process import ServerThread

            if args.warmup_buckets:
                print(f"engine.warmup: {bench.scorer.engine.warmup()}", file=sys.stderr)
            cfg = ServerConfig(
                host="127.0.0.1",
                port=0,
                metrics_port=0,
                warmup=False,
                template=args.template,
                loaded=bench.scorer.model,
                engine=bench.scorer.engine,
            )
            server = ServerThread(cfg).start()
            target, metrics_target, pid = server.target, f"127.0.0.1:{server.server.metrics_port}", os.getpid()
        else:
            target, metrics_target = args.target, bench.metrics_target
            pid = bench.served.proc.pid if bench.served else args.target_pid
            if metrics_target is None:
                raise SystemExit("soak against --target reads its metrics: give --metrics-target")
        with ScoreClient(target) as client:
            info = client.model_info()
        limits = ServerLimits(int(info.vocab_size), int(info.limits.max_items), int(info.context_length))
        traffic = Traffic(target, args.concurrency, bench.sizes, bench.labels, limits, args.seed)
        context = bench.context()
        print(
            f"soak: {args.duration:.0f} s in windows of {args.window:.0f} s, {args.concurrency} clients, "
            f"model {context['model']} | {context['backend']} | {target} | commit {context['commit']}",
            flush=True,
        )
        windows, unsettled = soak(traffic, Probe(metrics_target, pid), args.duration, args.window, _flushed)
    finally:
        if server is not None:
            server.stop()
        bench.close()
    trends = judge(windows)
    failures = verdict(windows, trends, unsettled)
    print(report(trends, unsettled, failures))
    if args.json_path:
        record = {
            "workload": "soak",
            "mode": "prefix",
            **context,
            "duration_s": args.duration,
            "window_s": args.window,
            "concurrency": args.concurrency,
            "sizes": dataclasses.asdict(bench.sizes),
            "actions": ACTIONS,
            "windows": windows,
            "trends": [dataclasses.asdict(t) for t in trends],
            "unsettled": unsettled,
            "failures": failures,
            "passed": not failures,
        }
        Path(args.json_path).write_text(json.dumps([record], indent=2, default=str))
    return 0 if not failures else 1


def _flushed(line: str) -> None:
    print(line, flush=True)  # a long run's log shows each window as it closes
