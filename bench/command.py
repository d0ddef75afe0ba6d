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
from collections.abc import Callable, Sequence

from prefixscore.bench.runner import run_workloads
from prefixscore.bench.workloads import MODES, RERANK_TEMPLATE, W7_MODES, W8_MODES, WORKLOADS
from prefixscore.engine import options

# what `all` leaves out: w5 runs through a router, the others run alone
NOT_IN_ALL = ("w5", "w7", "w8", "soak", "faults")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="run the benchmark workloads (docs/benchmarks.md)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # the engine's options as `serve` takes them (engine/options.py), in process and with --serve-process;
    # the bench's own defaults: its CPU-sized model, and Qwen3-Reranker's prompt on any model for
    # the rerank workloads (docs/benchmarks.md)
    options.add_flags(p, defaults={"model": "bench-cpu", "template": RERANK_TEMPLATE})
    p.add_argument("--devices", type=int, default=None, help="devices to use in process (default: all)")
    p.add_argument("--target", default=None, help="host:port of a running server: every workload over gRPC")
    p.add_argument(
        "--serve-process",
        action="store_true",
        help="start `prefixscore serve` (with these engine options: --model, --dtype, ...) in a process of "
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
        type=_list(WORKLOADS, [w for w in WORKLOADS if w not in NOT_IN_ALL and not w.startswith("w6")]),
        default=["w1-cold"],
        help=f"comma list of {','.join(WORKLOADS)}, or all (all but w5, which runs through a router: "
        "--target ROUTER --replica-metrics, w6, which needs a one-logit classifier: "
        "--model bench-cpu-reward, w7 and w8, which run alone, soak, which runs alone for --duration, and "
        "faults, which runs alone for --fault-seeds) [w1-cold]",
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
    p.add_argument("--w7-header", type=int, default=800, help="W7 shared header (k-shot examples) tokens [%(default)s]")
    p.add_argument("--w7-questions", type=int, default=50, help="W7 questions under the header [%(default)s]")
    p.add_argument("--w7-min-question", type=int, default=80, help="W7 shortest question [%(default)s]")
    p.add_argument("--w7-max-question", type=int, default=120, help="W7 longest question [%(default)s]")
    p.add_argument(
        "--w7-batch", type=int, default=16, help="W7 prompts per /v1/completions request (and hf batch) [%(default)s]"
    )
    p.add_argument(
        "--w7-modes",
        type=_list(W7_MODES),
        default=list(W7_MODES),
        help=f"W7 modes, comma-separated ({', '.join(W7_MODES)}; a baseline without its model or package is skipped) "
        "[all]",
    )
    p.add_argument(
        "--fault-seeds",
        type=int,
        default=200,
        help="faults: rounds of random work with injected faults, seeds --seed on (bench/faults.py) [%(default)s]",
    )
    p.add_argument("--w8-passages", type=int, default=2000, help="W8 passages (64-256 tokens) [%(default)s]")
    p.add_argument("--w8-queries", type=int, default=200, help="W8 queries (10-30 tokens) [%(default)s]")
    p.add_argument("--w8-batch", type=int, default=32, help="W8 inputs per request (and encode batch) [%(default)s]")
    p.add_argument(
        "--w8-clients",
        type=_counts,
        default=[1],
        help="W8: clients sending at once, comma-separated (1,4: each engine mode sequentially, then 4 at once) [1]",
    )
    p.add_argument(
        "--w8-modes",
        type=_list(W8_MODES),
        default=list(W8_MODES),
        help=f"W8 modes, comma-separated ({', '.join(W8_MODES)}) [all]",
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


def _counts(text: str) -> list[int]:
    """A comma list of positive integers, each once."""
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, each once")
    return counts


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


def run(args: argparse.Namespace) -> int:
    """`prefixscore bench`: the soak alone (bench/soak.py), every other workload list by runner.py."""
    if "soak" in args.workload:
        if args.workload != ["soak"]:
            raise SystemExit("soak runs alone: --workload soak")
        from prefixscore.bench import soak  # grpc and the soak's traffic load only when a soak runs

        return soak.run(args)
    if "w7" in args.workload:
        if args.workload != ["w7"]:
            raise SystemExit("w7 runs alone: --workload w7")
        from prefixscore.bench import w7  # lm-eval and transformers load only when W7 runs

        return w7.run(args)
    if "w8" in args.workload:
        if args.workload != ["w8"]:
            raise SystemExit("w8 runs alone: --workload w8")
        from prefixscore.bench import w8  # sentence-transformers and torch load only when W8 runs

        return w8.run(args)
    if "faults" in args.workload:
        if args.workload != ["faults"]:
            raise SystemExit("faults runs alone: --workload faults")
        from prefixscore.bench import faults

        return faults.run(args)
    return run_workloads(args)
