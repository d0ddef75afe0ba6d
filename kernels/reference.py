"""Reference shared-prefix attention in plain jax.numpy: the oracle for every fast path.

Shapes use these letters:
  n, T  tokens of a call's stream (items packed back to back, prefill chunks)
  s  prefix keys (dense); S segments, P pages per segment (kernels/paged.py)
  k  kv heads, g query heads per kv head (grouped-query attention), d head dim

Grouped-query attention is expressed by reshaping the query heads to
[kv_heads, group] instead of repeating K/V, so no K/V copy is ever made.
Softmax statistics (max, log-sum-exp) and the merge are float32 whatever the
input dtype: the merge subtracts LSEs, and bf16 LSEs would lose ~1e-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prefixscore.kernels.paged import (
    DEFAULT_LOGITS,
    NO_WINDOW,
    AttentionLogits,
    PagedAttentionMeta,
    causal_by_region,
    first_visible,
)

# the oracle takes a segment starting at any token
SEGMENT_ALIGN = 1
# the pool holds K/V in the model's dtype (kernels/paged.py: pool_dtype)
POOL_AS_BITS = False
# no short prefill chunks take key steps together (kernels/paged.py: SharedSteps)
SHARED_BLOCK = 0

# Finite, so a fully masked row gives a very negative LSE instead of NaN; the
# merge then weighs that part by exp(-huge) = 0.
MASK_VALUE = -1e30


def _attend(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, logits: AttentionLogits
) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention returning the output and its float32 LSE.

    q: [..., n, k, g, d]; k, v: [..., s, k, d]; mask: broadcastable to [..., k, g, n, s].
    Returns out [..., n, k, g, d] (q.dtype) and lse [..., n, k, g] (float32).
    """
    scores = jnp.einsum("...nkgd,...skd->...kgns", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, logits.apply(scores, q.shape[-1]), MASK_VALUE)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("...kgns,...skd->...nkgd", (probs / denom).astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = (row_max + jnp.log(denom))[..., 0]  # [..., k, g, n]
    return out.astype(q.dtype), jnp.moveaxis(lse, -1, -3)


def prefix_attention(
    q: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
    positions: jax.Array,
    window: jax.Array | int = NO_WINDOW,
    logits: AttentionLogits = DEFAULT_LOGITS,
) -> tuple[jax.Array, jax.Array]:
    """Queries against one dense prefix, no causal mask.

    q: [n, heads, d]; prefix_k, prefix_v: [s, kv_heads, d]; prefix_len: scalar int,
    keys at positions >= prefix_len are masked, and the keys before each query's
    first_visible(positions [n], window).
    Returns out [n, heads, d] and lse [n, heads] float32.
    """
    n, heads, d = q.shape
    kv_heads = prefix_k.shape[1]
    qg = q.reshape(n, kv_heads, heads // kv_heads, d)
    key = jnp.arange(prefix_k.shape[0])[None, :]
    valid = (key < prefix_len) & (key >= first_visible(positions, window)[:, None])  # [n, s]
    out, lse = _attend(qg, prefix_k, prefix_v, valid[None, None], logits)
    return out.reshape(n, heads, d), lse.reshape(n, heads)


def segment_prefix(pool: jax.Array, meta: PagedAttentionMeta, segment: jax.Array | int) -> jax.Array:
    """One segment's prefix keys (or values) gathered dense from the pool: [P * page_tokens, kv, d]."""
    pages = pool[meta.layer][:, meta.page_table[segment]]  # [kv, P, page_tokens, d]
    kv_heads, p, page_tokens, d = pages.shape
    return pages.reshape(kv_heads, p * page_tokens, d).transpose(1, 0, 2)


def paged_prefix_attention(
    q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> tuple[jax.Array, jax.Array]:
    """Every token against its own segment's prefix pages, no causal mask (kernels/paged.py).

    q: [T, heads, d]; pool_k, pool_v: [layers, kv, pages, page_tokens, d]. The oracle: each
    segment's pages gathered dense, all tokens attended, rows of that segment kept.
    Returns out [T, heads, d] and lse [T, heads] float32 (0 and MASK_VALUE where a token sees no
    prefix key: prefix_len 0, or all of it before the token's window).
    """
    n, heads, _ = q.shape

    def segment(s: jax.Array, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        k_s, v_s = segment_prefix(pool_k, meta, s), segment_prefix(pool_v, meta, s)
        out, lse = prefix_attention(q, k_s, v_s, meta.prefix_len[s], meta.positions, meta.window, meta.logits)
        mine = (meta.segment_ids == s)[:, None]
        return jnp.where(mine[..., None], out, acc[0]), jnp.where(mine, lse, acc[1])

    init = (jnp.zeros(q.shape, q.dtype), jnp.full((n, heads), MASK_VALUE, jnp.float32))
    out, lse = jax.lax.fori_loop(0, meta.page_table.shape[0], segment, init)
    # a token that sees no prefix key saw only masked ones: weigh it 0 in the merge
    empty = (first_visible(meta.positions, meta.window) >= jnp.take(meta.prefix_len, meta.segment_ids))[:, None]
    return jnp.where(empty[..., None], 0, out).astype(q.dtype), jnp.where(empty, MASK_VALUE, lse)


def ragged_item_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    max_item_len: jax.Array | int | None = None,
    window: jax.Array | int = NO_WINDOW,
    logits: AttentionLogits = DEFAULT_LOGITS,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of items packed back to back in one token stream (no padding between them).

    q: [n, heads, d]; k, v: [n, kv_heads, d]; segment_ids: [n] int32, equal for the
    (contiguous) tokens of one item. Token i sees token j <= i of its own item, and with a
    window only i - j < window (positions are contiguous within an item: kernels/paged.py).
    max_item_len is a hint for the fast paths (an upper bound on any item's length);
    the oracle builds the dense [n, n] mask and ignores it.
    Returns out [n, heads, d] and lse [n, heads] float32.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(n, kv_heads, heads // kv_heads, d)
    idx = jnp.arange(n)
    back = idx[:, None] - idx[None, :]  # [n, n]: how far key j lies before query i
    mask = (segment_ids[:, None] == segment_ids[None, :]) & (back >= 0) & (back < window)
    out, lse = _attend(qg, k, v, mask[None, None], logits)
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


def paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> jax.Array:
    """The whole attention of a device call's stream (kernels/paged.py): prefix part from the
    pool, causal part per item, merged. q: [T, heads, d]; k, v: [T, kv, d]. Returns [T, heads, d]."""
    out_p, lse_p = paged_prefix_attention(q, pool_k, pool_v, meta)
    out_i, lse_i = causal_by_region(ragged_item_attention, q, k, v, meta)
    return merge_attention(out_p, lse_p, out_i, lse_i)
