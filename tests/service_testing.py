"""Helpers for the gRPC service tests (imported by tests/test_service_*.py and tests/test_cli*.py)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from prefixscore.service.core import ServerConfig

LABELS = [28, 1017]  # two token ids of the tiny-qwen3 (SmolLM2) vocabulary


def server_config(scorer, **overrides) -> ServerConfig:
    """A loopback server (free ports) over an in-process Scorer's model and engine, not warmed up."""
    base = dict(host="127.0.0.1", port=0, metrics_port=0, loaded=scorer.model, engine=scorer.engine, warmup=False)
    return ServerConfig(**{**base, **overrides})


def scrape(port: int) -> dict[str, float]:
    """GET /metrics -> {"name{label=value,...}": value} for every sample."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_for(condition: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> object:
    """Poll `condition` until it is truthy (returns it) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
