"""Jitted forward passes: query prefill, items over a shared prefix, and full sequences.

These are the padded-batch forms (one row per item or sequence): the oracle
paths tests compare the engine against, and the `packed` baseline. The engine
itself serves through model/ragged.py. All shapes are padded by the caller.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from prefixscore.kernels import dispatch, xla
from prefixscore.model.config import ModelConfig
from prefixscore.model.decoder import Params, embed, label_probs, last_hidden, run_layers


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"))
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, attn_impl: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Run the query once and return its KV cache.

    tokens: [s] int32, padded after the real tokens (causality keeps padding
    out of real positions; the padded keys are masked later by prefix_len).
    Returns keys, values: [layers, s, kv_heads, hd] (post-RoPE).
    """
    impl = dispatch.get(attn_impl)
    x = embed(params, tokens[None])
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, (k, v) = run_layers(params, cfg, x, positions, lambda q, k, v, _: impl.causal_attention(q, k, v))
    return k[:, 0], v[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "apply_softmax", "attn_impl"))
def score_items(
    params: Params,
    cfg: ModelConfig,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
    items: jax.Array,
    item_lens: jax.Array,
    label_ids: jax.Array,
    label_valid: jax.Array,
    apply_softmax: bool,
    attn_impl: str = "xla",
) -> jax.Array:
    """Score a batch of items as parallel sequences over one shared prefix.

    prefix_k, prefix_v: [layers, s, kv_heads, hd]; prefix_len: scalar int32;
    items: [b, t] int32 (padded); item_lens: [b] (>= 1); label_ids, label_valid: [labels].
    Item token j sits at position prefix_len + j, as in a plain forward pass.
    Returns label probabilities [b, labels] float32.
    """
    impl = dispatch.get(attn_impl)
    x = embed(params, items)
    positions = prefix_len + jnp.arange(items.shape[1], dtype=jnp.int32)

    def attend(q, k, v, layer_prefix):
        pk, pv = layer_prefix
        return impl.shared_prefix_attention(q, k, v, pk, pv, prefix_len)

    h, _ = run_layers(params, cfg, x, positions, attend, (prefix_k, prefix_v))
    return label_probs(params, cfg, last_hidden(h, item_lens), label_ids, label_valid, apply_softmax)


@functools.partial(jax.jit, static_argnames=("cfg", "apply_softmax", "attn_impl"))
def score_sequences(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    lengths: jax.Array,
    label_ids: jax.Array,
    label_valid: jax.Array,
    apply_softmax: bool,
    attn_impl: str = "xla",
) -> jax.Array:
    """Plain causal forward of whole sequences, scored at each last real token.

    Serves `item_first` and the `sequential` baseline. tokens: [b, s] int32
    padded; lengths: [b]. Returns [b, labels] float32.
    """
    impl = dispatch.get(attn_impl)
    x = embed(params, tokens)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    h, _ = run_layers(params, cfg, x, positions, lambda q, k, v, _: impl.causal_attention(q, k, v))
    return label_probs(params, cfg, last_hidden(h, lengths), label_ids, label_valid, apply_softmax)


# the packed baseline's sequence length is padded to a multiple of this (a key chunk)
PACKED_ALIGN = 1024


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> jax.Array:
    """Block-diagonal attention over one packed sequence.

    q: [1, s, heads, d]; k, v: [1, s, kv_heads, d]; segments: [s] (0 the query, i + 1 item i,
    -1 padding). A token sees earlier tokens of its own segment and the query. Every query
    block scores every key (the O(s^2) cost of packing is kept: a custom-mask kernel cannot
    skip blocks), with the fast path's tiling, so the baseline is not handicapped by a naive
    kernel; the mask is evaluated per tile from the segment ids, never materialised.
    """

    def visible(q_idx: jax.Array, k_idx: jax.Array) -> jax.Array:
        sq, sk = segments[q_idx][:, None], segments[k_idx][None, :]
        return ((sk == sq) | ((sk == 0) & (sq >= 0))) & (k_idx[None, :] <= q_idx[:, None])

    return xla.dense_masked_attention(q[0], k[0], v[0], visible)[None]


@functools.partial(jax.jit, static_argnames=("cfg", "apply_softmax"))
def score_packed(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    read_at: jax.Array,
    label_ids: jax.Array,
    label_valid: jax.Array,
    apply_softmax: bool,
) -> jax.Array:
    """The `packed` baseline: query and all items in one sequence, block-diagonal mask.

    tokens, positions, segments: [s] (s a multiple of PACKED_ALIGN); segment 0 is the
    query, item i is segment i + 1, -1 is padding. read_at: [n] index of each item's
    last token. Returns [n, labels]. Attention is dense over the whole sequence
    (the O(N^2) cost the seeds measured); the mask is built on the device from the
    segment ids rather than shipped, which only flatters the baseline.
    """
    x = embed(params, tokens[None])
    h, _ = run_layers(params, cfg, x, positions, lambda q, k, v, _: packed_attention(q, k, v, segments))
    return label_probs(params, cfg, h[0, read_at], label_ids, label_valid, apply_softmax)
