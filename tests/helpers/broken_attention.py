"""A deliberately wrong attention implementation (for tests/test_kernels_selfcheck.py): the XLA
path with a merge that drops the prefix part instead of weighting the two parts by their LSEs,
the kind of bug a miscompiled kernel produces. Exports everything dispatch needs."""

from __future__ import annotations

import jax

from prefixscore.kernels.paged import PagedAttentionMeta, causal_by_region
from prefixscore.kernels.xla import (  # noqa: F401  (the rest of the implementation's interface)
    POOL_AS_BITS,
    SEGMENT_ALIGN,
    SHARED_BLOCK,
    key_step_pages,
    paged_prefix_attention,
    ragged_item_attention,
)


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    return out_b.astype(out_a.dtype)  # the item part alone: every prefix key is lost


def paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> jax.Array:
    out_p, lse_p = paged_prefix_attention(q, pool_k, pool_v, meta)
    out_i, lse_i = causal_by_region(ragged_item_attention, q, k, v, meta)
    return merge_attention(out_p, lse_p, out_i, lse_i)
