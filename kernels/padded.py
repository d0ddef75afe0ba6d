"""Padded item batches served by a packed (ragged) kernel: each batch row is one segment."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def padded_from_ragged(
    ragged_fn: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
) -> jax.Array:
    """q: [b, t, heads, d]; k, v: [b, t, kv, d]; prefix_k/v: [s, kv, d] -> [b, t, heads, d].

    Padding sits after each row's real tokens, so the causal mask inside a segment
    keeps it out of every real token, exactly as in the padded reference.
    """
    b, t, heads, d = q.shape
    seg = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    out = ragged_fn(
        q.reshape(b * t, heads, d),
        k.reshape(b * t, -1, d),
        v.reshape(b * t, -1, d),
        seg,
        t,
        prefix_k,
        prefix_v,
        prefix_len,
    )
    return out.reshape(b, t, heads, d)


def padded_items_from_ragged(
    ragged_item_fn: Callable[..., tuple[jax.Array, jax.Array]], q: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Causal attention within each row through a packed per-segment kernel.

    q: [b, t, heads, d]; k, v: [b, t, kv, d] -> out [b, t, heads, d], lse [b, t, heads] float32.
    """
    b, t, heads, d = q.shape
    seg = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    out, lse = ragged_item_fn(q.reshape(b * t, heads, d), k.reshape(b * t, -1, d), v.reshape(b * t, -1, d), seg, t)
    return out.reshape(b, t, heads, d), lse.reshape(b, t, heads)
