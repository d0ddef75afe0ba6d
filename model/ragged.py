"""Per-device forward functions the engine compiles: chunked query prefill, and items
packed back to back (ragged, unpadded) over a shared prefix KV.

These are plain functions of fixed shapes; model/engine.py wraps them in
`shard_map` over the device mesh and `jit`, one executable per bucket. Every
length that varies between requests (query length, item lengths, item count,
the longest item) is a runtime value driving a loop's trip count, never a
shape, so it costs no compilation and no padded compute.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp

from prefixscore.model.config import ModelConfig
from prefixscore.model.decoder import Params, embed, label_probs, run_layers


def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, length: jax.Array, *, chunk: int, impl: ModuleType):
    """Run a query in chunks into a KV buffer.

    tokens: [s] int32 (s a multiple of chunk; real tokens first); length: int32 scalar.
    Chunk c attends to the buffer's first c * chunk keys (the prefix part) and
    causally to itself; only ceil(length / chunk) chunks run. Keys past `length`
    hold garbage and are masked by every later reader through the prefix length.
    Returns keys, values: [layers, s, kv_heads, hd] (post-RoPE).
    """
    s = tokens.shape[0]
    shape = (cfg.num_layers, s, cfg.num_kv_heads, cfg.head_dim)
    dtype = params["embed"].dtype

    def run_chunk(c: jax.Array, kv: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        keys, values = kv
        start = c * chunk
        x = embed(params, jax.lax.dynamic_slice_in_dim(tokens, start, chunk)[None])
        positions = start + jnp.arange(chunk, dtype=jnp.int32)

        def attend(q, k, v, layer_kv):
            out_p, lse_p = impl.prefix_attention(q[0], layer_kv[0], layer_kv[1], start)
            out_c, lse_c = impl.item_attention(q, k, v)
            return impl.merge_attention(out_p[None], lse_p[None], out_c, lse_c)

        _, (k, v) = run_layers(params, cfg, x, positions, attend, (keys, values))
        keys = jax.lax.dynamic_update_slice_in_dim(keys, k[:, 0], start, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(values, v[:, 0], start, axis=1)
        return keys, values

    init = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    return jax.lax.fori_loop(0, (length + chunk - 1) // chunk, run_chunk, init)


def score_stream(
    params: Params,
    cfg: ModelConfig,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
    stream: jax.Array,
    read_at: jax.Array,
    n_items: jax.Array,
    max_item_len: jax.Array,
    label_ids: jax.Array,
    n_labels: jax.Array,
    apply_softmax: jax.Array,
    *,
    impl: ModuleType,
    head_rows: int,
) -> jax.Array:
    """Score items packed back to back in one token stream over one shared prefix.

    prefix_k, prefix_v: [layers, s, kv_heads, hd]; prefix_len: int32 scalar (0: no prefix,
    whole sequences); stream: [3, T] int32 rows (token ids, RoPE positions, item index;
    -1 marks padding after the last item); read_at: [R] stream index of each item's last
    token; n_items, max_item_len: int32 scalars; label_ids: [L]; n_labels: int32 scalar;
    apply_softmax: bool scalar (a runtime branch: both heads share one executable).
    Returns label probabilities [R, L] float32 (rows >= n_items are zero).
    """
    tokens, positions, segments = stream[0], stream[1], stream[2]
    x = embed(params, tokens[None])

    def attend(q, k, v, layer_prefix):
        out = impl.ragged_shared_prefix_attention(
            q[0], k[0], v[0], segments, max_item_len, layer_prefix[0], layer_prefix[1], prefix_len
        )
        return out[None]

    h, _ = run_layers(params, cfg, x, positions, attend, (prefix_k, prefix_v))
    h_last = jnp.take(h[0], read_at, axis=0)  # [R, hidden]
    label_valid = jnp.arange(label_ids.shape[0]) < n_labels
    rows = h_last.shape[0]
    step = min(head_rows, rows)
    if rows % step:
        step = rows

    def head(softmax: bool) -> jax.Array:
        # the full-vocabulary projection only for rows that hold an item, `step` rows at a time
        def body(i: jax.Array, out: jax.Array) -> jax.Array:
            hs = jax.lax.dynamic_slice_in_dim(h_last, i * step, step)
            probs = label_probs(params, cfg, hs, label_ids, label_valid, softmax)
            return jax.lax.dynamic_update_slice_in_dim(out, probs, i * step, axis=0)

        out = jnp.zeros((rows, label_ids.shape[0]), jnp.float32)
        return jax.lax.fori_loop(0, (n_items + step - 1) // step, body, out)

    return jax.lax.cond(apply_softmax, lambda: head(True), lambda: head(False))
