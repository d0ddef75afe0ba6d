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
from prefixscore.model.decoder import Params, embed, output_weight, rms_norm, run_layers

# vocabulary rows per step of the full-vocabulary log-sum-exp: a [rows, VOCAB_CHUNK]
# float32 logits tile stays in cache instead of a [rows, vocab] matrix in memory
VOCAB_CHUNK = 2048
# the smallest step of the output head (see head_rows_loop)
MIN_HEAD_ROWS = 32


def prefill(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    length: jax.Array,
    *,
    chunk: int,
    impl: ModuleType,
    axis: str | None = None,
    devices: int = 1,
):
    """Run a query in chunks into a KV buffer.

    tokens: [s] int32 (s a multiple of chunk; real tokens first); length: int32 scalar.
    Chunk c attends to the buffer's first c * chunk keys (the prefix part) and
    causally to itself; only ceil(length / chunk) chunks run. Keys past `length`
    hold garbage and are masked by every later reader through the prefix length.

    With `axis` (called inside shard_map over `devices` devices) the prefill is split
    along the sequence instead of repeated on every device: device i runs slice i
    (chunk / devices tokens) of each chunk through the layers; per layer the slices'
    K/V are all-gathered, so each slice attends to all keys before it, and the
    finished buffer is the same on every device (items read it replicated).
    Returns keys, values: [layers, s, kv_heads, hd] (post-RoPE).
    """
    s = tokens.shape[0]
    shape = (cfg.num_layers, s, cfg.num_kv_heads, cfg.head_dim)
    dtype = params["embed"].dtype
    width = chunk // devices  # tokens of a chunk each device runs
    me = jax.lax.axis_index(axis) if axis else 0

    def gathered(x: jax.Array, dim: int) -> jax.Array:
        """This chunk's slices of every device, in token order, along `dim`."""
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True) if axis else x

    def run_chunk(c: jax.Array, kv: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        keys, values = kv
        chunk_start = c * chunk
        start = chunk_start + me * width
        x = embed(params, jax.lax.dynamic_slice_in_dim(tokens, start, width)[None])
        positions = start + jnp.arange(width, dtype=jnp.int32)

        def attend(q, k, v, layer_kv):
            prefix_k, prefix_v = layer_kv
            if axis:  # the chunk's earlier slices were computed by the other devices
                prefix_k = jax.lax.dynamic_update_slice_in_dim(prefix_k, gathered(k[0], 0), chunk_start, axis=0)
                prefix_v = jax.lax.dynamic_update_slice_in_dim(prefix_v, gathered(v[0], 0), chunk_start, axis=0)
            out_p, lse_p = impl.prefix_attention(q[0], prefix_k, prefix_v, start)
            out_c, lse_c = impl.item_attention(q, k, v)
            return impl.merge_attention(out_p[None], lse_p[None], out_c, lse_c)

        _, (k, v) = run_layers(params, cfg, x, positions, attend, (keys, values))
        keys = jax.lax.dynamic_update_slice_in_dim(keys, gathered(k[:, 0], 1), chunk_start, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(values, gathered(v[:, 0], 1), chunk_start, axis=1)
        return keys, values

    init = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    return jax.lax.fori_loop(0, (length + chunk - 1) // chunk, run_chunk, init)


def vocab_logsumexp(h: jax.Array, w: jax.Array) -> jax.Array:
    """log(sum(exp(h @ w.T))) per row without materialising the logits.

    h: [rows, hidden] (normalised); w: [vocab, hidden]. Returns [rows] float32.
    An online max/sum over VOCAB_CHUNK-row slices of w (plus one static remainder).
    """
    vocab = w.shape[0]
    chunk = min(VOCAB_CHUNK, vocab)
    full = vocab // chunk

    def update(carry: tuple[jax.Array, jax.Array], wc: jax.Array) -> tuple[jax.Array, jax.Array]:
        m, total = carry
        s = jnp.einsum("rh,vh->rv", h, wc, preferred_element_type=jnp.float32)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        return m_new, total * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]), axis=-1)

    def step(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return update(carry, jax.lax.dynamic_slice_in_dim(w, i * chunk, chunk))

    rows = h.shape[0]
    carry = jax.lax.fori_loop(
        0, full, step, (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    )
    if vocab > full * chunk:
        carry = update(carry, w[full * chunk :])
    return carry[0] + jnp.log(carry[1])


def label_probs(
    params: Params,
    cfg: ModelConfig,
    h_last: jax.Array,
    label_ids: jax.Array,
    label_valid: jax.Array,
    apply_softmax: jax.Array | bool,
) -> jax.Array:
    """decoder.label_probs, with the full-vocabulary normaliser computed in cache-sized tiles,
    and apply_softmax a runtime flag (one executable serves both; only the needed head runs).

    h_last: [rows, hidden]; label_ids, label_valid: [labels]. Returns [rows, labels] float32.
    """
    h = rms_norm(h_last, params["final_norm"], cfg.rms_norm_eps)
    w = output_weight(params)
    logits = jnp.einsum("bh,lh->bl", h, jnp.take(w, label_ids, axis=0), preferred_element_type=jnp.float32)
    return jax.lax.cond(
        apply_softmax,
        lambda: jax.nn.softmax(jnp.where(label_valid, logits, -jnp.inf), axis=-1),
        lambda: jnp.exp(logits - vocab_logsumexp(h, w)[:, None]),
    )


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
    head = lambda hs: label_probs(params, cfg, hs, label_ids, label_valid, apply_softmax)
    return head_rows_loop(head, h_last, n_items, head_rows)


def head_rows_loop(fn, h_last: jax.Array, n_items: jax.Array, head_rows: int = 256) -> jax.Array:
    """Run the output head only on the rows that hold an item.

    fn(h [rows, hidden]) -> [rows, out]. Full steps of `head_rows` rows run in a loop; the
    remainder takes one step of the smallest size in head_rows / 2^k (>= MIN_HEAD_ROWS) that
    covers it. Each step streams the whole output matrix (the full-vocabulary projection is
    memory-bound for few rows), so few, well-filled steps beat many exact ones. A step near the
    end is clamped back into range (dynamic slices clamp) and recomputes a few rows identically.
    Returns [R, out] float32; rows past n_items are zero or garbage.
    """
    rows = h_last.shape[0]
    big = min(head_rows, rows)
    sizes = [big]
    while sizes[-1] // 2 >= MIN_HEAD_ROWS:
        sizes.append(sizes[-1] // 2)
    sizes = sizes[::-1]  # ascending
    n_out = jax.eval_shape(fn, jax.ShapeDtypeStruct((big, h_last.shape[1]), h_last.dtype)).shape[1]

    def run(start: jax.Array, size: int, out: jax.Array) -> jax.Array:
        hs = jax.lax.dynamic_slice_in_dim(h_last, start, size)
        start = jnp.minimum(start, rows - size)  # where dynamic_slice clamped it
        return jax.lax.dynamic_update_slice_in_dim(out, fn(hs), start, axis=0)

    out = jnp.zeros((rows, n_out), jnp.float32)
    full = n_items // big
    if rows == big:
        # a loop over one full-size slice would be loop-invariant: XLA hoists its body out of
        # the loop and runs it even for zero trips, so branch instead
        out = jax.lax.cond(full > 0, lambda o: run(0, big, o), lambda o: o, out)
    else:
        out = jax.lax.fori_loop(0, full, lambda i, o: run(i * big, big, o), out)
    done = full * big
    rest = n_items - done
    # branch 0: nothing left; branch k: one step of sizes[k - 1] rows
    pick = jnp.where(rest == 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes), rest))
    branches = [lambda o: o] + [lambda o, z=z: run(done, z, o) for z in sizes]
    return jax.lax.switch(jnp.minimum(pick, len(sizes)), branches, out)
