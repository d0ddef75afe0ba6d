"""The persistent XLA compilation cache: compiled executables kept on disk between runs,
so a restarted server (or a second replica on the same volume) skips compilation."""

from __future__ import annotations

import os

import jax

ENV = "PREFIXSCORE_COMPILE_CACHE_DIR"


OFF = ("off", "none", "false", "0")


def default_dir() -> str:
    """Under the user's cache directory ($XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "prefixscore", "jax")


def enable(path: str | os.PathLike[str] | None = None) -> str | None:
    """Point jax's `jax_compilation_cache_dir` at `path`, else $PREFIXSCORE_COMPILE_CACHE_DIR, else
    default_dir(): on by default, so a restarted server compiles nothing. "off" disables it.

    Returns the directory in use, or None when disabled. Every executable is cached, however
    fast it compiled: the small models of tests compile in under jax's default 1 s threshold.
    """
    path = os.fspath(path) if path else (os.environ.get(ENV) or default_dir())
    if path.strip().lower() in OFF:
        return None
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        try:  # a cache already initialised in this process keeps its old directory otherwise
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
        except (ImportError, AttributeError):  # pragma: no cover - private API moved
            pass
    return path
