"""How big the prefix pool is on each device: the bytes of one page, and how many pages the
engine (engine/runtime/scoring_engine.py) allocates once, at its start: the bytes asked for, or a
share of the device memory the weights left, never more than POOL_CONTEXTS full contexts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prefixscore.model.config import DTYPES, ModelConfig

# the pool's share of the device memory left after the weights, on devices that report it
# (engine/options.py's default of --pool-memory-fraction; tests/test_engine_options.py checks)
POOL_MEMORY_FRACTION = 0.5
# without a device memory figure (CPU): this budget
DEFAULT_POOL_BYTES = 1 << 30
# never more than this many full contexts, unless asked for in bytes: more pages than any
# traffic pins would only slow the page book, and small models would take a device's memory
POOL_CONTEXTS = 64


def page_bytes(cfg: ModelConfig, dtype: str, page_tokens: int, kv_heads: int) -> int:
    """Bytes of one page on one device: keys and values of page_tokens tokens in every layer,
    for the `kv_heads` KV heads that device stores."""
    return 2 * cfg.num_layers * kv_heads * page_tokens * cfg.head_dim * jnp.dtype(DTYPES[dtype]).itemsize


def pool_pages(
    device: jax.Device,
    bytes_per_page: int,
    max_pages: int,
    pool_bytes: int | None,
    fraction: float = POOL_MEMORY_FRACTION,
) -> int:
    """The pool's pages on each device (at least a full context's, `max_pages`, and one): explicit
    `pool_bytes`; else `fraction` of the device memory left after the weights, or (CPU)
    DEFAULT_POOL_BYTES, either capped at POOL_CONTEXTS full contexts."""
    if pool_bytes:
        budget = pool_bytes
    else:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            budget = int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
        else:
            budget = DEFAULT_POOL_BYTES
        budget = min(budget, POOL_CONTEXTS * max_pages * bytes_per_page)
    return int(max(max_pages + 1, budget // bytes_per_page))
