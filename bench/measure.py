"""One workload x mode measured against a bench session: its warm-up (compilations counted) and
then its timed requests, one after another or from its concurrent clients, with the server's CPU
time and the replicas' counts around them, as one record; and one W1 request traced by jax.profiler."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prefixscore.bench import workloads as wl
from prefixscore.bench.backends import Backend, InProcess
from prefixscore.bench.metrics import replica_counts, token_share
from prefixscore.bench.session import Bench
from prefixscore.bench.timing import Timing, percentile
from prefixscore.telemetry import host_cost


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


def measure_workload(bench: Bench, workload: str, mode: str, gen: wl.Generator) -> dict[str, Any]:
    from prefixscore.telemetry.compiles import CompileCounter

    args = bench.args
    target = bench.target(workload, mode)
    workers = bench.concurrency(workload)
    n_timed = {
        "w2": bench.sizes.w2_requests,
        "w3-grpc": bench.sizes.w3_requests,
        "w4": bench.sizes.w4_requests,
        "host": args.host_requests,
        "host-rerank": args.host_requests,
    }.get(workload, args.runs)
    n_warm = max(args.warmup_runs, 1 if workload == "w1-warm" else 0)
    if workers:
        n_warm = min(n_warm * workers, n_timed)
    if workload == "w5":  # warm-up over queries of its own (the shapes compile; nothing timed is cached)
        warm, timed = bench.requests(workload, 1, gen), bench.requests(workload, args.w5_queries, gen)
    else:
        reqs = bench.requests(workload, n_warm + n_timed, gen)
        if workload == "w1-warm":  # the warm-up request puts the (one) query in the prefix cache
            reqs = [reqs[0]] * n_warm + reqs[n_warm:]
        if mode == "sequential":
            k = bench.sizes.sequential_items
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
    stats0 = dict(bench.scorer.engine.stats) if bench.scorer is not None else None
    tokens0 = bench.token_counts()
    compiles = CompileCounter.count()
    # the server's CPU time by thread kind around the timed run: when it runs in a process of
    # its own (in this one, the bench's client threads would count too)
    cpu0 = bench.host_cpu() if workers else None
    replicas0 = [replica_counts(m) for m in args.replica_metrics] if workload == "w5" else []
    timing = _timed(bench, target, workload, mode, timed, workers)
    cpu1 = bench.host_cpu() if cpu0 is not None else None
    record = _record(bench, workload, mode, timed, timing, warmup, stats0, CompileCounter.count() - compiles)
    tokens1 = bench.token_counts()
    if tokens0 is not None and tokens1 is not None and mode != "packed":
        record |= token_share(tokens0, tokens1)
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


def _timed(
    bench: Bench, target: Backend, workload: str, mode: str, reqs: list[wl.Request], workers: int | None
) -> Timing:
    timing = Timing()
    progress = Progress(len(reqs), f"{workload}/{mode}", bench.args.progress)

    def send(r: wl.Request) -> tuple[float, int, int]:
        t = time.perf_counter()
        scores, cached = target.score(r, mode)
        elapsed = time.perf_counter() - t
        assert len(scores) == len(r.items)
        progress.update()
        return elapsed, cached, bench.flops(r, cached)

    if workers:
        # the machine's matmul rate right before and after the run: a shared machine's speed
        # drifts between runs, and the utilisation share cancels that drift out
        before = bench.peak.probe() if bench.peak else 0.0
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(send, reqs))
        timing.wall = time.perf_counter() - started
        timing.peaks.append(max(before, bench.peak.probe() if bench.peak else 0.0))
    else:
        results = []
        started = time.perf_counter()
        before = bench.peak.probe() if bench.peak else 0.0
        for r in reqs:
            results.append(send(r))
            after = bench.peak.probe() if bench.peak else 0.0
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


def _record(
    bench: Bench,
    workload: str,
    mode: str,
    reqs: list[wl.Request],
    timing: Timing,
    warmup: dict[str, float],
    stats0: dict[str, int] | None,
    steady_compiles: int,
) -> dict[str, Any]:
    utilisation = None
    requests_per_s = None
    if workload in wl.CONCURRENT:  # one concurrent run: totals over its wall time
        items_per_s = sum(timing.items) / timing.wall
        requests_per_s = len(timing.items) / timing.wall
        flops_per_s = sum(timing.flops) / timing.wall
        if timing.peaks and all(timing.peaks) and bench.cfg is not None:
            utilisation = flops_per_s / timing.peaks[0]
    else:  # one request per run: the median run
        items_per_s = statistics.median(n / t for n, t in zip(timing.items, timing.latencies, strict=True))
        rates = [f / t for f, t in zip(timing.flops, timing.latencies, strict=True)]
        flops_per_s = statistics.median(rates)
        if timing.peaks and all(timing.peaks) and bench.cfg is not None:
            utilisation = statistics.median(r / p for r, p in zip(rates, timing.peaks, strict=True))
    padding = None
    if stats0 is not None and mode != "packed":
        s1 = bench.scorer.engine.stats
        device = s1["device_tokens"] - stats0["device_tokens"]
        padding = 1 - (s1["tokens"] - stats0["tokens"]) / device if device else None
    ms = [t * 1000 for t in timing.latencies]
    return {
        "workload": workload,
        "mode": mode,
        **bench.context(),
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
        "achieved_flops_per_s": flops_per_s if bench.cfg is not None else None,
        "utilisation": utilisation,
        "peaks_around_requests": timing.peaks,
        "sizes": dataclasses.asdict(bench.sizes),
    }


def profile_w1(bench: Bench, log_dir: Path, gen: wl.Generator) -> dict[str, Any]:
    """Trace one W1 request over a new query (prefill included) after its shapes have
    compiled; returns bench/profile.py's summary, also written to log_dir/summary.json
    (with the compiled HLO the summary maps kernels through)."""
    import jax

    from prefixscore.bench import profile

    target = InProcess(bench.scorer)
    warm, cold = bench.requests("w1-cold", 2, gen)
    target.score(warm, "prefix")  # compiles what the traced request needs, if no run did
    with jax.profiler.trace(str(log_dir)):
        started = time.perf_counter()
        target.score(cold, "prefix")
        wall = time.perf_counter() - started
    hlo = bench.scorer.engine.hlo_texts()
    summary = profile.summarize(profile.latest_xplane(log_dir), hlo, wall)
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (log_dir / "executables.hlo.txt").write_text("\n".join(hlo))  # to summarize the trace again elsewhere
    return summary
