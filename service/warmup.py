"""The warm-up's side of the service: the later stages compiled in the background while serving,
and what the log says of a warm-up."""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.engine.runtime.warmup import WarmupStage
from prefixscore.telemetry.compiles import CompileCounter
from prefixscore.telemetry.logs import event

log = logging.getLogger("prefixscore.server")

# a background warm-up compiles on this many threads, niced: requests are being served beside it
# (measured on 2 cores, SmolLM2 from a warm cache: 4 threads at normal priority doubled the first
# request's 2.1 s)
BACKGROUND_COMPILE_THREADS = 2


def peak_host_memory() -> int:
    """The process's peak resident memory in bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(engine: ScoringEngine, compiled: dict, compiles: int, compile_s: float, started: float) -> dict[str, Any]:
    """The log fields of a warm-up (or its first stage) since `started` and the counts then."""
    return dict(
        executables=compiled.get("executables"),
        compilations=CompileCounter.count() - compiles,
        compile_seconds=round(CompileCounter.seconds() - compile_s, 3),
        seconds=round(time.monotonic() - started, 3),
        compile_cache=engine.compile_cache_dir,
    )


def in_background(
    engine: ScoringEngine,
    stages: list[WarmupStage],
    call_shapes: int,
    stop: threading.Event,
    on_stage: Callable[[], None],
    on_failure: Callable[[BaseException], None],
) -> threading.Thread:
    """Compile `stages` on a thread of their own (started) while serving; `on_stage` after each
    is compiled (it is planned into from then on), `on_failure` if one fails to compile (the work
    waiting for its shapes would never run: the process restarts); `stop` ends it early."""

    def run() -> None:
        compiles, compile_s, started = CompileCounter.count(), CompileCounter.seconds(), time.monotonic()
        try:
            compiled = engine.compile_stages(stages, BACKGROUND_COMPILE_THREADS, on_stage=on_stage, stop=stop, nice=10)
        except Exception as err:
            log.exception("background warm-up failed")
            on_failure(err)
            return
        if engine.shapes_ready == call_shapes:
            event(
                log, "warmed_up", warmup=True, background=True, **report(engine, compiled, compiles, compile_s, started)
            )
        elif stop.is_set():  # shut down first: the compile in progress ended, the rest never started
            event(log, "warmup_stopped", call_shapes_ready=engine.shapes_ready, call_shapes=call_shapes)

    thread = threading.Thread(target=run, name="prefixscore-warmup", daemon=True)
    thread.start()
    return thread
