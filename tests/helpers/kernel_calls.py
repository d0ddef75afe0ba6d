"""Calling an attention kernel as the decoder traces it (for the kernel tests)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from prefixscore.kernels.paged import NO_WINDOW, PagedAttentionMeta


@functools.cache
def _jitted(fn: Callable, no_window: bool) -> Callable:
    plain = functools.partial(dataclasses.replace, window=NO_WINDOW)
    return jax.jit(lambda *arrays, meta: fn(*arrays, plain(meta) if no_window else meta))


def with_meta(fn: Callable, *arrays: jax.Array, meta: PagedAttentionMeta):
    """fn(*arrays, meta) jitted. A meta without a window keeps the Python int NO_WINDOW inside the
    trace, as model/step.py traces a model with no sliding layer: passed as a jit argument it would
    become an array, and the kernels would take their windowed steps instead of their plain ones."""
    return _jitted(fn, isinstance(meta.window, int))(*arrays, meta=meta)
