"""The staged warm-up: which call shapes are compiled in which order (`plan_stages`), and
compiling them stage by stage (`compile_in_stages`), so a server can serve from the first
stage while the rest compiles. The engine (engine/runtime/scoring_engine.py `warmup`,
`warmup_stages`, `compile_stages`) runs them over its buckets and its executables' table.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.model.call_inputs import CallShape
from prefixscore.telemetry.compiles import CompileCounter


@dataclasses.dataclass(frozen=True)
class WarmupStage:
    """One step of a staged warm-up: the call shapes it compiles, and the buckets calls may be
    planned in once they (and every earlier stage's) are compiled."""

    buckets: Buckets
    shapes: tuple[CallShape, ...]


def plan_stages(b: Buckets) -> list[WarmupStage]:
    """Every call shape of the buckets, in stages in the order traffic needs them (see WarmupStage).

    The first stage is the smallest item bucket, with and without the smallest prefill
    region that holds a chunk: it serves any request whose items fit that bucket (more
    work runs as more calls). Then the item buckets up to max_batch_tokens, smallest
    first (fuller calls), the larger prefill regions (longer new queries per call), and
    last the buckets for items longer than max_batch_tokens, which run alone. Each stage
    adds one bucket of one axis beside every bucket of the other axis already compiled.

    Buckets with token-logprob forms (Buckets.top_logprobs) compile them second, in the first
    stage's sizes, and with every stage after: the first stage, what a server waits for before
    it serves, is no longer for them; a call with such rows waits until then."""
    short = [t for t in b.tokens if t <= b.max_batch_tokens] or [b.tokens[0]]
    long = [t for t in b.tokens if t not in short]
    first_prefill = Buckets.fit(b.prefill[1:], b.prefill_chunk, "prefill tokens")
    tokens, prefill = [short[0]], [0, first_prefill]
    top_logprobs = 0  # the token-logprob forms, once their stage comes
    steps: list[tuple[str | None, int]] = [(None, 0)]
    steps += [("top_logprobs", b.top_logprobs)] if b.top_logprobs else []
    steps += [("tokens", t) for t in short[1:]]
    steps += [("prefill", p) for p in b.prefill[1:] if p != first_prefill]
    steps += [("tokens", t) for t in long]
    stages: list[WarmupStage] = []
    seen: set[CallShape] = set()
    for axis, size in steps:
        if axis == "tokens":
            tokens.append(size)
        elif axis == "prefill":
            prefill.append(size)
        elif axis == "top_logprobs":
            top_logprobs = size
        ready_short = [t for t in tokens if t <= b.max_batch_tokens]
        buckets = dataclasses.replace(
            b,
            tokens=tuple(sorted(tokens)),
            prefill=tuple(sorted(prefill)),
            max_batch_tokens=max(ready_short, default=b.max_batch_tokens),
            max_prefill_tokens=max(prefill),
            top_logprobs=top_logprobs,
            token_logprobs_wait=top_logprobs != b.top_logprobs,
        )
        shapes = buckets.call_shapes()
        stages.append(WarmupStage(buckets, tuple(s for s in shapes if s not in seen)))
        seen.update(shapes)
    return stages


def compile_in_stages(
    stages: Sequence[WarmupStage],
    compile_shape: Callable[[CallShape], Any],
    on_stage: Callable[[WarmupStage], None],
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
    nice: int = 0,
) -> dict[str, float]:
    """`compile_shape` each stage's shapes in order, each stage's in parallel (XLA compiles
    without the GIL), then `on_stage(stage)`. `stop` set: no further shape is started and no
    further stage reported. `nice`: the compiling threads' niceness (Linux). Returns
    {"executables", "compilations", "seconds"}; with a warm persistent cache, compilations is 0."""
    count, started = CompileCounter.count(), time.perf_counter()
    workers = workers or min(4, os.cpu_count() or 1)
    total = sum(len(stage.shapes) for stage in stages)
    stopped = lambda: stop is not None and stop.is_set()  # noqa: E731

    def compile_one(shape: CallShape) -> None:
        if not stopped():
            compile_shape(shape)

    done = 0
    with concurrent.futures.ThreadPoolExecutor(workers, initializer=_niced, initargs=(nice,)) as pool:
        for stage in stages:
            if stopped():
                break
            for _ in pool.map(compile_one, stage.shapes):
                done += 1
                if progress:
                    progress(done, total)
            if stopped():
                break
            on_stage(stage)
    return {
        "executables": total,
        "compilations": CompileCounter.count() - count,
        "seconds": time.perf_counter() - started,
    }


def _niced(nice: int) -> None:
    """Lower this thread's priority: Linux keeps a nice value per thread."""
    if nice and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
