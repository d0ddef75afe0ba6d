"""A deliberately wrong attention implementation (for tests/test_kernels_selfcheck.py): the XLA
path with a merge that averages the prefix and item parts instead of weighting them by their
LSEs, the kind of bug a miscompiled kernel produces."""

from __future__ import annotations

import jax

from prefixscore.kernels.xla import (  # noqa: F401  (the rest of the implementation's interface)
    causal_attention,
    item_attention,
    prefix_attention,
    ragged_item_attention,
)


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    return (out_a + out_b) / 2


def ragged_shared_prefix_attention(q, k, v, segment_ids, max_item_len, prefix_k, prefix_v, prefix_len):
    out_p, lse_p = prefix_attention(q, prefix_k, prefix_v, prefix_len)
    out_i, lse_i = ragged_item_attention(q, k, v, segment_ids, max_item_len)
    return merge_attention(out_p, lse_p, out_i, lse_i)
