"""What `prefixscore bench` prints and derives from its records: each prefix record's speedup over
the baselines, W2/W3/W4/W6's model FLOP rate as a share of W1-cold's, and the tables (workloads,
host CPU per request, W5's replicas) and lines (shares, medians over rounds)."""

from __future__ import annotations

import statistics
from typing import Any

from prefixscore.bench.backends import InProcess

# workloads whose model FLOP rate is reported as a share of W1-cold's
SHARED_WITH_W1_COLD = ("w2", "w3", "w3-grpc", "w4", "w6", "w6-one-by-one")
SHARE_KEY = "flop_rate_share_of_w1_cold"
# the same share with each rate taken against the matmul rate measured around it
UTIL_SHARE_KEY = "utilisation_share_of_w1_cold"


def add_speedups(records: list[dict[str, Any]]) -> None:
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


def add_shares(records: list[dict[str, Any]]) -> None:
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


def table(records: list[dict[str, Any]]) -> str:
    """One row per record: speed, latency, FLOP rate, utilisation, compile time, padding, tokens
    computed over tokens requested, hits."""
    head = (
        f"{'workload':<9} {'mode':<10} {'items/s':>9} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} "
        f"{'GFLOP/s':>8} {'util':>6} {'compile s':>9} {'pad %':>6} {'comp/req':>8} {'hit %':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        lat = r["latency_ms"]
        gf = r["achieved_flops_per_s"]
        util = r.get("utilisation")
        pad, hit, ratio = r["padding_share"], r["prefix_cache_hit_rate"], r.get("computed_over_requested")
        lines.append(
            f"{r['workload']:<9} {r['mode']:<10} {r['items_per_s']:>9.1f} {lat['p50']:>9.1f} {lat['p95']:>9.1f} "
            f"{lat['p99']:>9.1f} {(gf or 0) / 1e9:>8.1f} {(util or 0) * 100:>5.1f}% {r['compile_seconds']:>9.2f} "
            f"{'-' if pad is None else f'{pad * 100:.1f}':>6} {'-' if ratio is None else f'{ratio:.2f}':>8} "
            f"{'-' if hit is None else f'{hit * 100:.0f}':>6}"
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
