"""`prefixscore bench` over the selected workloads and modes (all but the soak): the device's matmul
peak around them, each (workload, mode) measured in turn for --rounds rounds, the records finished
with the peak, speedups and shares, printed as tables and written as JSON; then the optional
profile (--profile) and collectives (--collectives) of the in-process engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefixscore.bench import reports
from prefixscore.bench import workloads as wl
from prefixscore.bench.measure import measure_workload, profile_w1
from prefixscore.bench.session import Bench
from prefixscore.bench.timing import Peak


def run_workloads(args: argparse.Namespace) -> int:
    """Run the selected workloads and modes; print the table; write --json."""
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
                one_mode = workload in wl.CONCURRENT or workload == "w6-one-by-one" or not in_process
                modes = ["prefix"] if one_mode else args.mode
                if workload == "w5":
                    modes = list(wl.W5_MODES)
                for mode in modes:
                    records.append({**measure_workload(bench, workload, mode, gen), "round": round_})
        if bench.peak:
            bench.peak.measure()
        if args.profile and in_process:
            profiled = profile_w1(bench, Path(args.profile), gen)
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
        reports.add_speedups([r for r in records if r["round"] == round_])
        reports.add_shares([r for r in records if r["round"] == round_])
    ctx = records[0] if records else {}
    served = ctx.get("quantization") or {}
    weights = f" | projections {served['weights']}" if served.get("weights") else ""
    if served.get("activations"):
        weights += f", activations {served['activations']}"
    print(
        f"model {ctx.get('model')} {ctx.get('dtype')}{weights} | {ctx.get('backend')} x{ctx.get('devices')} "
        f"({ctx.get('device_kind', '')}) | attention {ctx.get('attention')} | commit {ctx.get('commit')}"
    )
    if peak:
        print(f"peak: {peak.best / 1e9:.1f} GFLOP/s (best {peak.name}); util: vs the matmul timed around each request")
    print(reports.table(records))
    if reports.host_table(records):
        print(reports.host_table(records))
    if reports.replica_table(records):
        print(reports.replica_table(records))
    for r in records:
        if r.get("speedup"):
            print(f"{r['workload']} prefix vs {', '.join(f'{m} {x:.1f}x' for m, x in r['speedup'].items())}")
    shares = reports.share_lines(records) + reports.median_lines(records)
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
