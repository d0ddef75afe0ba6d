"""Batch lines sent to running servers' HTTP APIs, each to the target its prefix key picks.

The choice is rendezvous hashing of (prefix key, target): every line over one query goes to the
same target, where its KV is cached, and adding or removing a target moves only the queries that
hashed to it. This is a consistent pick per line, not a router: each target is a replica (or a
router, such as deploy/envoy, that routes on the same key). Lines are sent concurrently; the
server shares one prefill among requests over a query that is still being prefilled."""

from __future__ import annotations

import concurrent.futures
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from prefixscore import prefix_key
from prefixscore.offline.lines import BatchLine, answered, failed

PATHS = {"score": "/v1/score", "rerank": "/v1/rerank", "embed": "/v1/embeddings"}
RETRY_STATUS = (429, 503)  # queue full, loading or draining: the same request succeeds later
REFUSED_ATTEMPTS = 30  # of a request answered with RETRY_STATUS, then its answer is the line's
TRANSPORT_ATTEMPTS = 6  # of a request the target did not answer (refused or dropped connection)


def pick(key: str, targets: Sequence[str]) -> str:
    """The target of a prefix key: the highest hash of (key, target)."""
    return max(targets, key=lambda t: zlib.crc32(f"{key}\n{t}".encode()))


class HttpBackend:
    def __init__(
        self, targets: Sequence[str], concurrency: int = 16, token: str | None = None, timeout_s: float = 600.0
    ) -> None:
        if not targets:
            raise ValueError("targets: give at least one URL")
        self.targets = [t if "://" in t else f"http://{t}" for t in targets]
        headers = {"authorization": f"Bearer {token}"} if token else None
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.clients = {
            t: httpx.Client(base_url=t, headers=headers, timeout=timeout_s, limits=limits) for t in self.targets
        }
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="batch-http")
        self.prefills = None  # counted by each server (prefixscore_prefix_cache_misses_total)

    def answer(self, groups: list[list[BatchLine]]) -> Iterator[dict[str, Any]]:
        """The output line of every line of a window, as each comes back."""
        futures = [self.pool.submit(self._send, line) for group in groups for line in group]
        for future in concurrent.futures.as_completed(futures):
            yield future.result()

    def _send(self, line: BatchLine) -> dict[str, Any]:
        client = self.clients[pick(line.key, self.targets)]
        headers = {prefix_key.HEADER: line.key} if line.key else None
        delay, attempt = 0.05, 0
        while True:
            attempt += 1
            try:
                response = client.post(PATHS[line.kind], json=line.body, headers=headers)
            except httpx.TransportError as err:
                if attempt >= TRANSPORT_ATTEMPTS:
                    return failed(line.custom_id, None, 503, f"{client.base_url}: {err}")
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if response.status_code in RETRY_STATUS and attempt < REFUSED_ATTEMPTS:
                time.sleep(float(response.headers.get("retry-after", delay)))
                delay = min(delay * 2, 5.0)
                continue
            rid = response.headers.get("x-request-id")
            try:
                body = response.json()
            except ValueError:
                body = response.text
            if response.status_code == 200:
                return answered(line.custom_id, rid, body)
            return failed(line.custom_id, rid, response.status_code, body)

    def close(self) -> None:
        self.pool.shutdown()
        for client in self.clients.values():
            client.close()
