"""Shared-prefix attention for NVIDIA GPUs as Pallas Triton kernels: the `pallas_gpu` implementation.

Same functions and shapes as kernels/reference.py. Off GPU the kernels run in
Pallas' generic interpreter (tests use it on CPU).

Why not cuDNN (`jax.nn.dot_product_attention(implementation="cudnn",
return_residual=True)`)? Its residual LSE comes back in the input dtype: in
bfloat16 an LSE of ~10 carries an error of ~0.04, i.e. ~4% on the merge weight
of each part, far outside the 2e-2 parity budget; and its `is_causal` mask is
top-left aligned, wrong for queries that sit after a prefix. These kernels keep
every statistic in float32 and take the prefix length as a runtime value.

Grid: (query block, query head). A program loads its queries once and loops over
key blocks; the K/V index maps send query head h to kv head h // group, so
grouped-query heads share K/V through the cache, never through a copy.
- prefix: key blocks 0 .. ceil(prefix_len / BLOCK_K) (the padding of a prefix bucket
  is never read);
- ragged items: key blocks from the block where the query block's first item
  starts to the diagonal (the stream's segment starts, read in the kernel);
- merge: an elementwise XLA fusion (nothing to gain from a kernel).
Shapes Triton cannot tile (head_dim not a power of two, token counts not
multiples of the blocks) fall back to kernels/xla.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from prefixscore.kernels import dispatch, xla
from prefixscore.kernels.padded import padded_from_ragged, padded_items_from_ragged
from prefixscore.kernels.reference import MASK_VALUE, merge_attention

__all__ = [
    "causal_attention",
    "item_attention",
    "merge_attention",
    "prefix_attention",
    "ragged_item_attention",
    "ragged_shared_prefix_attention",
    "shared_prefix_attention",
]

BLOCK_Q = 128  # prefix part: queries per program
BLOCK_K = 64  # prefix part: keys per loop step
ITEM_BLOCK = 64  # item part: queries per program and keys per step
LOG2E = math.log2(math.e)


def _interpret() -> bool:
    return dispatch.target_backend() != "gpu"


def _params(d: int) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _online(carry, s, v):
    """One online-softmax step in base 2. s: [bq, bk] float32 scores * log2(e) (masked: MASK_VALUE)."""
    m_prev, l_prev, acc = carry
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_next[:, None])
    corr = jnp.exp2(m_prev - m_next)
    l_next = l_prev * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
    return m_next, l_next, acc


def _finish(m, total, acc):
    """Normalise; rows that saw no key give 0 and LSE MASK_VALUE. Returns out, natural-log LSE."""
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, MASK_VALUE, (m + jnp.log2(safe)) / LOG2E)
    return acc / safe[:, None], lse


# ---- prefix part ----------------------------------------------------------------------
def _prefix_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale):
    q = q_ref[...]  # [BLOCK_Q, d]
    length = len_ref[0]
    bq, d = q.shape

    def step(j, carry):
        k = k_ref[pl.ds(j * BLOCK_K, BLOCK_K), :]
        v = v_ref[pl.ds(j * BLOCK_K, BLOCK_K), :]
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * (scale * LOG2E)
        col = j * BLOCK_K + jnp.arange(BLOCK_K)
        return _online(carry, jnp.where(col[None, :] < length, s, MASK_VALUE), v)

    init = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    out, lse = _finish(*jax.lax.fori_loop(0, (length + BLOCK_K - 1) // BLOCK_K, step, init))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def prefix_attention(
    q: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array, prefix_len: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """All item-token queries against the prefix. q: [n, heads, d]; prefix_k, prefix_v: [s, kv, d];
    prefix_len: int32 scalar. Returns out [n, heads, d] and lse [n, heads] float32."""
    n, heads, d = q.shape
    s, kv_heads, _ = prefix_k.shape
    if not _pow2(d) or s % BLOCK_K:
        return xla.prefix_attention(q, prefix_k, prefix_v, prefix_len)
    g = heads // kv_heads
    pad = -n % BLOCK_Q
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    rows = n + pad
    out, lse = pl.pallas_call(
        functools.partial(_prefix_kernel, scale=d**-0.5),
        grid=(rows // BLOCK_Q, heads),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h: (0,)),
            pl.BlockSpec((BLOCK_Q, None, d), lambda i, h: (i, h, 0)),
            pl.BlockSpec((s, None, d), lambda i, h: (0, h // g, 0)),
            pl.BlockSpec((s, None, d), lambda i, h: (0, h // g, 0)),
        ],
        out_specs=[
            pl.BlockSpec((BLOCK_Q, None, d), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, BLOCK_Q), lambda i, h: (h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, heads, d), q.dtype),
            jax.ShapeDtypeStruct((heads, rows), jnp.float32),
        ],
        compiler_params=_params(d),
        interpret=_interpret(),
    )(jnp.reshape(prefix_len, (1,)).astype(jnp.int32), qp, prefix_k, prefix_v)
    return out[:n], lse.T[:n]


# ---- ragged item part ----------------------------------------------------------------------
def _ragged_kernel(start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale):
    i = pl.program_id(0)
    q = q_ref[...]  # [ITEM_BLOCK, d]
    bq, d = q.shape
    q_start = start_ref[pl.ds(i * ITEM_BLOCK, ITEM_BLOCK)]  # first stream index of each row's item
    q_pos = i * ITEM_BLOCK + jnp.arange(ITEM_BLOCK)
    first = start_ref[pl.ds(i * ITEM_BLOCK, 1)][0] // ITEM_BLOCK  # the block's first item starts here

    def step(j, carry):
        k = k_ref[pl.ds(j * ITEM_BLOCK, ITEM_BLOCK), :]
        v = v_ref[pl.ds(j * ITEM_BLOCK, ITEM_BLOCK), :]
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * (scale * LOG2E)
        k_pos = j * ITEM_BLOCK + jnp.arange(ITEM_BLOCK)
        mask = (k_pos[None, :] >= q_start[:, None]) & (k_pos[None, :] <= q_pos[:, None])
        return _online(carry, jnp.where(mask, s, MASK_VALUE), v)

    init = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    out, lse = _finish(*jax.lax.fori_loop(first, i + 1, step, init))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[n] -> the stream index where each token's (contiguous) segment starts."""
    idx = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones((1,), bool), segment_ids[1:] != segment_ids[:-1]])
    return jax.lax.cummax(jnp.where(is_start, idx, 0))


def ragged_item_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, max_item_len: jax.Array | int
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of packed items. q: [n, heads, d]; k, v: [n, kv, d]; segment_ids: [n].
    Returns out [n, heads, d], lse [n, heads] float32 (max_item_len unused: the kernel
    reads where each block's first item starts)."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    if not _pow2(d) or n % ITEM_BLOCK:
        return xla.ragged_item_attention(q, k, v, segment_ids, max_item_len)
    g = heads // kv_heads
    out, lse = pl.pallas_call(
        functools.partial(_ragged_kernel, scale=d**-0.5),
        grid=(n // ITEM_BLOCK, heads),
        in_specs=[
            pl.BlockSpec((n,), lambda i, h: (0,)),
            pl.BlockSpec((ITEM_BLOCK, None, d), lambda i, h: (i, h, 0)),
            pl.BlockSpec((n, None, d), lambda i, h: (0, h // g, 0)),
            pl.BlockSpec((n, None, d), lambda i, h: (0, h // g, 0)),
        ],
        out_specs=[
            pl.BlockSpec((ITEM_BLOCK, None, d), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, ITEM_BLOCK), lambda i, h: (h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((heads, n), jnp.float32)],
        compiler_params=_params(d),
        interpret=_interpret(),
    )(segment_starts(segment_ids), q, k, v)
    return out, lse.T


def item_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal attention within each row (the prefill chunk; padded item batches), via the ragged
    kernel with one segment per row. q: [b, t, heads, d]; k, v: [b, t, kv, d]."""
    return padded_items_from_ragged(ragged_item_attention, q, k, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Plain causal self-attention. q: [b, s, heads, d]; k, v: [b, s, kv, d] -> [b, s, heads, d]."""
    return item_attention(q, k, v)[0]


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
    """Packed items over one prefix: q [n, heads, d]; k, v [n, kv, d]; segment_ids [n] -> [n, heads, d]."""
    out_p, lse_p = prefix_attention(q, prefix_k, prefix_v, prefix_len)
    out_i, lse_i = ragged_item_attention(q, k, v, segment_ids, max_item_len)
    return merge_attention(out_p, lse_p, out_i, lse_i)


def shared_prefix_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array, prefix_len: jax.Array
) -> jax.Array:
    """Padded item batches over one prefix. q: [b, t, heads, d]; k, v: [b, t, kv, d] -> [b, t, heads, d]."""
    return padded_from_ragged(ragged_shared_prefix_attention, q, k, v, prefix_k, prefix_v, prefix_len)
