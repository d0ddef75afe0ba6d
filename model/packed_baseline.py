"""The `packed` baseline: query and all items in one sequence under a block-diagonal mask.

What the seed system measured against (docs/benchmarks.md, W1): kept so the bench can
report the prefix path's speed-up over it in the same run. The engine serves through
model/step.py.
"""

from __future__ import annotations

import functools

import jax

from prefixscore.kernels import xla
from prefixscore.model.config import ModelConfig
from prefixscore.model.decoder import embed, label_probs, run_layers
from prefixscore.model.weights import Weights

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
    params: Weights,
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
    x = embed(params, cfg, tokens[None])
    h, _ = run_layers(params, cfg, x, positions, lambda q, k, v, _, st: (packed_attention(q, k, v, segments), st))
    return label_probs(params, cfg, h[0, read_at], label_ids, label_valid, apply_softmax)
