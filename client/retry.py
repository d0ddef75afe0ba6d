"""What a client retries when a replica goes away (`Retry`), and how: the unary methods by gRPC's
own retry policy (its service config) and, past what that policy can retry, by `unary_steps`."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc

from prefixscore.client.errors import stream_reset
from prefixscore.client.steps import Steps
from prefixscore.v1 import score_service_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ScoreService"].full_name
# The unary methods, safe to send again: scoring changes nothing on the server. ScoreStream is
# not among them: gRPC retries a stream only until its first answer, and our failover does more.
RETRIED_METHODS = ("Score", "Rerank", "Embed", "GetModelInfo")


@dataclasses.dataclass(frozen=True)
class Retry:
    """What a client retries when a replica goes away (`ScoreClient(..., retry=Retry())`).

    Unary calls (Score, Rerank, Embed, GetModelInfo): gRPC's own retry policy in the channel's service
    config (`retry_service_config`), on UNAVAILABLE only, at most `attempts` tries of a call
    (the first included; gRPC caps it at 5), each try picked anew by the channel's load
    balancing (round_robin moves on to another replica; ring_hash hashes to the same one,
    passing it only once its connection failed; pick_first stays on its connection while up).
    Streams: `stream_reopens` re-opens over one stream's life (see `ScoreStream`). Backoff
    before a retry or re-open: random up to `initial_backoff_s`, times `backoff_multiplier` per
    try, at most `max_backoff_s` (gRPC's jitter)."""

    attempts: int = 3
    stream_reopens: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 2 <= self.attempts <= 5:
            raise ValueError(f"attempts: gRPC retries 2 to 5 tries of a call, got {self.attempts}")
        if self.stream_reopens < 0:
            raise ValueError(f"stream_reopens: expected >= 0, got {self.stream_reopens}")
        if not 0.001 <= self.initial_backoff_s <= self.max_backoff_s or self.backoff_multiplier <= 0:
            raise ValueError(f"backoff: expected 0.001 <= initial <= max and a positive multiplier: {self}")

    def backoff(self, tried: int) -> float:
        """Seconds to wait before try number `tried + 1` (`tried` >= 1), as gRPC does."""
        cap = min(self.initial_backoff_s * self.backoff_multiplier ** (tried - 1), self.max_backoff_s)
        return random.uniform(0, cap)


def retry_service_config(retry: Retry) -> str:
    """gRPC service config (JSON) retrying the unary methods on UNAVAILABLE (gRFC A6)."""
    policy = {
        "maxAttempts": retry.attempts,
        "initialBackoff": f"{retry.initial_backoff_s:.3f}s",
        "maxBackoff": f"{retry.max_backoff_s:.3f}s",
        "backoffMultiplier": retry.backoff_multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    names = [{"service": SERVICE_NAME, "method": m} for m in RETRIED_METHODS]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (time.monotonic()), none below 0; None: no deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def unary_steps(
    method: Callable[..., Any],
    request: Any,
    timeout: float | None,
    metadata: Any,
    retry: Retry | None,
    sleep: Callable[[float], Any],
) -> Steps[Any]:
    """One Score or Rerank call, as steps. With `retry`, one whose stream was reset under it
    (`stream_reset`: its replica died while its answer was on the way, past what gRPC's policy
    and a proxy retry) is sent again, within `attempts` tries and `timeout` (scoring changes
    nothing)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    tried = 1
    while True:
        try:
            return (yield partial(method, request, timeout=remaining(deadline), metadata=metadata))
        except grpc.RpcError as err:
            if retry is None or not stream_reset(err) or tried >= retry.attempts:
                raise
            yield partial(sleep, retry.backoff(tried))
            tried += 1
