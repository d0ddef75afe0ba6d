"""A server's Prometheus endpoint read by the benches: every sample by name, what one replica
behind a router did, and the server's CPU time by thread kind (the host cost)."""

from __future__ import annotations

import urllib.request


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


def token_counts(samples: dict[str, float]) -> dict[str, float]:
    """From a scrape: the tokens the device computed (real and the padding computed beside them),
    the calls' buckets (real and all padding) and the tokens the requests needed, each once."""
    real = sum(v for k, v in samples.items() if k.startswith("prefixscore_tokens_total{"))
    return {
        "computed": samples.get("prefixscore_computed_tokens_total", 0.0),
        "buckets": real + samples.get("prefixscore_padding_tokens_total", 0.0),
        "requested": samples.get("prefixscore_requested_tokens_total", 0.0),
    }


def token_share(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """A report's token fields between two `token_counts`: computed, the buckets', requested, and
    computed over requested (1.0: every computed token was needed, once)."""
    computed, buckets, requested = (after[k] - before[k] for k in ("computed", "buckets", "requested"))
    return {
        "computed_tokens": computed,
        "bucket_tokens": buckets,
        "requested_tokens": requested,
        "computed_over_requested": round(computed / requested, 3) if requested else None,
    }


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
