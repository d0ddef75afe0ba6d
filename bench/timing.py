"""What a timed run holds (latencies, items, model FLOPs, the matmul rate around each request),
latency percentiles, and the device's measured peak that achieved FLOP/s are compared with."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class Timing:
    latencies: list[float] = dataclasses.field(default_factory=list)
    items: list[int] = dataclasses.field(default_factory=list)
    flops: list[int] = dataclasses.field(default_factory=list)
    peaks: list[float] = dataclasses.field(default_factory=list)  # matmul FLOP/s around each request
    hits: int = 0
    wall: float = 0.0  # of a concurrent run


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


class Peak:
    """The device's measured peak: a large square matmul, timed in this process.

    probe() times one matmul; best is the fastest seen. The bench probes between
    timed requests, so each request is compared with what the machine delivered
    around it (a shared machine's background load cancels out of the ratio).
    """

    def __init__(self, dtype: str, n: int | None = None) -> None:
        import jax
        import jax.numpy as jnp

        self.n = n or (2048 if jax.default_backend() == "cpu" else 8192)
        self.dtype = dtype
        self._a = jnp.ones((self.n, self.n), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
        self._f = jax.jit(lambda x: x @ x)
        self._f(self._a).block_until_ready()
        self.best = 0.0

    def probe(self) -> float:
        t = time.perf_counter()
        self._f(self._a).block_until_ready()
        rate = 2 * self.n**3 / (time.perf_counter() - t)
        self.best = max(self.best, rate)
        return rate

    def measure(self, repeats: int = 5) -> float:
        return max(self.probe() for _ in range(repeats))

    @property
    def name(self) -> str:
        return f"{self.n}x{self.n}x{self.n} {self.dtype} matmul"
