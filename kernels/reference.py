"""Reference shared-prefix attention in plain jax.numpy: the oracle for every fast path.

Shapes use these letters:
  n  item-token queries folded into one sequence (batch * item_len)
  b  items in a device batch, t item length (padded)
  s  prefix length (padded bucket)
  k  kv heads, g query heads per kv head (grouped-query attention), d head dim

Grouped-query attention is expressed by reshaping the query heads to
[kv_heads, group] instead of repeating K/V, so no K/V copy is ever made.
Softmax statistics (max, log-sum-exp) and the merge are float32 whatever the
input dtype: the merge subtracts LSEs, and bf16 LSEs would lose ~1e-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so a fully masked row gives a very negative LSE instead of NaN; the
# merge then weighs that part by exp(-huge) = 0.
MASK_VALUE = -1e30


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention returning the output and its float32 LSE.

    q: [..., n, k, g, d]; k, v: [..., s, k, d]; mask: broadcastable to [..., k, g, n, s].
    Returns out [..., n, k, g, d] (q.dtype) and lse [..., n, k, g] (float32).
    """
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("...nkgd,...skd->...kgns", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask, scores, MASK_VALUE)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("...kgns,...skd->...nkgd", (probs / denom).astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = (row_max + jnp.log(denom))[..., 0]  # [..., k, g, n]
    return out.astype(q.dtype), jnp.moveaxis(lse, -1, -3)


def prefix_attention(
    q: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array, prefix_len: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """All item-token queries of a batch against the one shared prefix, no causal mask.

    q: [n, heads, d]; prefix_k, prefix_v: [s, kv_heads, d]; prefix_len: scalar int,
    keys at positions >= prefix_len are bucket padding and are masked.
    Returns out [n, heads, d] and lse [n, heads] float32.
    """
    n, heads, d = q.shape
    kv_heads = prefix_k.shape[1]
    qg = q.reshape(n, kv_heads, heads // kv_heads, d)
    valid = jnp.arange(prefix_k.shape[0]) < prefix_len  # [s]
    out, lse = _attend(qg, prefix_k, prefix_v, valid[None, None, None, :])
    return out.reshape(n, heads, d), lse.reshape(n, heads)


def item_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal attention of each item over its own tokens only.

    q: [b, t, heads, d]; k, v: [b, t, kv_heads, d]. Padding sits after an item's
    real tokens, so the causal mask alone keeps it out of every real token.
    Returns out [b, t, heads, d] and lse [b, t, heads] float32.
    """
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    out, lse = _attend(qg, k, v, causal[None, None, None])
    return out.reshape(b, t, heads, d), lse.reshape(b, t, heads)


def ragged_item_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, max_item_len: jax.Array | int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of items packed back to back in one token stream (no padding between them).

    q: [n, heads, d]; k, v: [n, kv_heads, d]; segment_ids: [n] int32, equal for the
    (contiguous) tokens of one item. Token i sees token j <= i of its own item.
    max_item_len is a hint for the fast paths (an upper bound on any item's length);
    the oracle builds the dense [n, n] mask and ignores it.
    Returns out [n, heads, d] and lse [n, heads] float32.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(n, kv_heads, heads // kv_heads, d)
    idx = jnp.arange(n)
    mask = (segment_ids[:, None] == segment_ids[None, :]) & (idx[None, :] <= idx[:, None])
    out, lse = _attend(qg, k, v, mask[None, None])
    return out.reshape(n, heads, d), lse.reshape(n, heads)


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Exact merge of two attention parts over disjoint key sets by their LSEs.

    out_*: [..., heads, d]; lse_*: [..., heads] float32. Returns [..., heads, d] in out_a.dtype.
    """
    m = jnp.maximum(lse_a, lse_b)
    wa = jnp.exp(lse_a - m)[..., None]
    wb = jnp.exp(lse_b - m)[..., None]
    merged = (out_a.astype(jnp.float32) * wa + out_b.astype(jnp.float32) * wb) / (wa + wb)
    return merged.astype(out_a.dtype)


def shared_prefix_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
) -> jax.Array:
    """Items as parallel sequences over one shared prefix (DESIGN.md, Hydragen split).

    q: [b, t, heads, d]; k, v: [b, t, kv_heads, d]; prefix_k, prefix_v: [s, kv_heads, d].
    Returns [b, t, heads, d].
    """
    b, t, heads, d = q.shape
    out_p, lse_p = prefix_attention(q.reshape(b * t, heads, d), prefix_k, prefix_v, prefix_len)
    out_i, lse_i = item_attention(q, k, v)
    return merge_attention(out_p.reshape(b, t, heads, d), lse_p.reshape(b, t, heads), out_i, lse_i)


def ragged_shared_prefix_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    max_item_len: jax.Array | int,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
) -> jax.Array:
    """Packed items over one shared prefix: q [n, heads, d]; k, v [n, kv_heads, d];
    segment_ids [n]; prefix_k, prefix_v [s, kv_heads, d]. Returns [n, heads, d]."""
    out_p, lse_p = prefix_attention(q, prefix_k, prefix_v, prefix_len)
    out_i, lse_i = ragged_item_attention(q, k, v, segment_ids, max_item_len)
    return merge_attention(out_p, lse_p, out_i, lse_i)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Plain causal self-attention (query prefill, full forward passes).

    q: [b, s, heads, d]; k, v: [b, s, kv_heads, d]. Returns [b, s, heads, d].
    """
    return item_attention(q, k, v)[0]
