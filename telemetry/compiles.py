"""Counting XLA compilations, so a test (and the start-up log) can prove steady state compiles nothing."""

from __future__ import annotations

import threading

import jax


class CompileCounter:
    """Counts XLA compilations process-wide (jax.monitoring), to prove steady state compiles nothing.

    An executable loaded from the persistent compilation cache is not a compilation:
    jax times cache loads under the same event, so cache hits are subtracted.
    seconds() is the time spent obtaining executables either way.
    """

    _lock = threading.Lock()
    _events = 0
    _hits = 0
    _seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_duration(event: str, duration: float, **_: object) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                with cls._lock:
                    cls._events += 1
                    cls._seconds += duration

        def on_event(event: str, **_: object) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                with cls._lock:
                    cls._hits += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    @classmethod
    def count(cls) -> int:
        with cls._lock:
            return cls._events - cls._hits

    @classmethod
    def obtained(cls) -> int:
        """Executables obtained so far, compiled or loaded from the persistent cache: steady state
        obtains none, whether or not the cache holds the shape (count() misses a cache load)."""
        with cls._lock:
            return cls._events

    @classmethod
    def cache_hits(cls) -> int:
        return cls._hits

    @classmethod
    def seconds(cls) -> float:
        return cls._seconds
