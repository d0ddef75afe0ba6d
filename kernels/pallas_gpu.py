"""Paged shared-prefix attention for NVIDIA GPUs as Pallas Triton kernels: the `pallas_gpu` implementation.

Same functions and shapes as kernels/reference.py; the stream and pool contract is
kernels/paged.py. Off GPU the kernels run in Pallas' generic interpreter (tests use
it on CPU).

Why not cuDNN (`jax.nn.dot_product_attention(implementation="cudnn",
return_residual=True)`)? Its residual LSE comes back in the input dtype: in
bfloat16 an LSE of ~10 carries an error of ~0.04, i.e. ~4% on the merge weight
of each part, far outside the 2e-2 parity budget; and its `is_causal` mask is
top-left aligned, wrong for queries that sit after a prefix. These kernels keep
every statistic in float32 and take prefix lengths and page tables as runtime values.

Grid: (query block, query head). A program loads its queries once and loops over
key blocks; query head h reads kv head h // group, so grouped-query heads share
K/V through the cache, never through a copy.
- prefix: the engine starts every segment at a multiple of SEGMENT_ALIGN, so a
  query block belongs to one segment; its program reads that segment's prefix
  length and page-table row and walks key blocks 0 .. ceil(prefix_len / BLOCK_K)
  through the pages (pages past the prefix are never read); on a windowed layer from
  the key block of the first key any of its rows sees, keys before a row's window masked;
- ragged items (per region of the stream, kernels/paged.py): key blocks from the
  block where the query block's first item starts (or, later, where its first row's
  window starts) to the diagonal (the stream's item starts, read in the kernel),
  keys a window hides masked;
- merge: an elementwise XLA fusion (nothing to gain from a kernel).
Shapes Triton cannot tile (head_dim not a power of two or under 16, token counts
not multiples of the blocks, pages not a multiple of BLOCK_K) fall back to kernels/xla.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from prefixscore.kernels import dispatch, xla
from prefixscore.kernels.paged import (
    DEFAULT_LOGITS,
    NO_WINDOW,
    AttentionLogits,
    PagedAttentionMeta,
    causal_by_region,
    first_keys,
    never_windowed,
    segment_starts,
)
from prefixscore.kernels.reference import MASK_VALUE, merge_attention

__all__ = [
    "SEGMENT_ALIGN",
    "merge_attention",
    "paged_attention",
    "paged_prefix_attention",
    "ragged_item_attention",
]

# Segment starts (and the prefill region's length) are multiples of this, so one prefix
# query block never straddles two segments' page tables.
SEGMENT_ALIGN = 64
# the pool holds K/V in the model's dtype (kernels/paged.py: pool_dtype)
POOL_AS_BITS = False
# no short prefill chunks take key steps together (kernels/paged.py: SharedSteps)
SHARED_BLOCK = 0
BLOCK_Q = SEGMENT_ALIGN  # prefix part: queries per program
BLOCK_K = 64  # prefix part: keys per loop step (a page holds a whole number of them)
ITEM_BLOCK = 64  # item part: queries per program and keys per step
LOG2E = math.log2(math.e)


def _interpret() -> bool:
    return dispatch.target_backend() != "gpu"


# Triton launch settings, measured on an H100 at W1's shapes (.ci/gpu_kernel_sweep.py:
# Qwen3-0.6B heads, bfloat16). One warpgroup (4 warps) per 64-row block beat 8 warps by
# about 8% in both kernels; the item kernel's short loops gain from a third stage.
PREFIX_STAGES, ITEM_STAGES = 2, 3
NUM_WARPS = 4


def _params(stages: int) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=stages)


def _tileable_dim(d: int) -> bool:
    """Triton tiles power-of-two dims, and tl.dot needs every operand dim >= 16."""
    return d >= 16 and d & (d - 1) == 0


def _scores(raw: jax.Array, logits: AttentionLogits, d: int) -> jax.Array:
    """Raw q.k [bq, bk] float32 -> logits in base 2 (without a soft cap, one multiply)."""
    if logits.softcap is None:
        return raw * (logits.scale_for(d) * LOG2E)
    return logits.apply(raw, d) * LOG2E


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


# ---- prefix part (paged) ------------------------------------------------------------------
def _prefix_kernel(layer_ref, seg_ref, len_ref, table_ref, q_ref, k_ref, v_ref, *refs, logits, table_width, windowed):
    """One query block x one query head against its segment's prefix pages.

    layer_ref [1], seg_ref [T], len_ref [S], table_ref [S * P] int32; q_ref [BLOCK_Q, d];
    k_ref, v_ref [layers, pages, page_tokens, d] (this program's kv head); then, `windowed`,
    low_ref [T] (the first key each token sees: first_keys); then o_ref, lse_ref. A model
    without sliding layers (never_windowed) compiles neither the window's operand nor its
    compare in every step (docs/benchmarks.md, H200).
    """
    low_ref, o_ref, lse_ref = refs if windowed else (None, *refs)
    i = pl.program_id(0)
    q = q_ref[...]  # [BLOCK_Q, d]
    bq, d = q.shape
    page_tokens = k_ref.shape[2]
    per_page = page_tokens // BLOCK_K
    layer = layer_ref[0]
    seg = seg_ref[pl.ds(i * BLOCK_Q, 1)][0]  # the whole block's segment (SEGMENT_ALIGN)
    length = len_ref[pl.ds(seg, 1)][0]
    row = seg * table_width  # this segment's page-table row in the flat table
    low = low_ref[pl.ds(i * BLOCK_Q, BLOCK_Q)] if windowed else None  # [BLOCK_Q]

    def step(j, carry):
        # j >= 0, so truncating lax.div/rem equal floor // and %; jnp's floor versions add sign
        # fix-ups that the Triton lowering rejects (a bool operand reaching its remainder)
        slot = jax.lax.div(j, per_page)
        page = table_ref[pl.ds(row + slot, 1)][0]
        off = (j - slot * per_page) * BLOCK_K
        k = k_ref[layer, page, pl.ds(off, BLOCK_K), :]  # [BLOCK_K, d]
        v = v_ref[layer, page, pl.ds(off, BLOCK_K), :]
        s = _scores(plgpu.dot(q, k, trans_b=True, allow_tf32=False), logits, d)
        col = j * BLOCK_K + jnp.arange(BLOCK_K)
        visible = col[None, :] < length
        if windowed:
            visible &= col[None, :] >= low[:, None]
        return _online(carry, jnp.where(visible, s, MASK_VALUE), v)

    init = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    # from the key block of the first key a row sees (0 without a window). A segment with
    # prefix_len 0 (or a block whose windows all start after it) runs no step: _finish gives
    # out 0, LSE MASK_VALUE
    first = jax.lax.div(jnp.min(low), BLOCK_K) if windowed else 0
    out, lse = _finish(*jax.lax.fori_loop(first, (length + BLOCK_K - 1) // BLOCK_K, step, init))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def paged_prefix_attention(
    q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> tuple[jax.Array, jax.Array]:
    """Every token against its own segment's prefix pages, no causal mask (kernels/paged.py).

    q: [T, heads, d]; pool_k, pool_v: [layers, kv, pages, page_tokens, d].
    Returns out [T, heads, d] (q.dtype) and lse [T, heads] float32 (MASK_VALUE, out 0
    where the segment's prefix_len is 0).
    """
    n, heads, d = q.shape
    layers, kv_heads, pages, page_tokens, _ = pool_k.shape
    if not _tileable_dim(d) or n % BLOCK_Q or page_tokens % BLOCK_K:
        return xla.paged_prefix_attention(q, pool_k, pool_v, meta)
    g = heads // kv_heads
    table_width = meta.page_table.shape[1]
    # The layer stays a kernel operand: a BlockSpec index map on Triton cannot read a
    # runtime value, and slicing the layer out in XLA (dynamic_index_in_dim) would hand
    # the custom call a copied [kv, pages, page_tokens, d] buffer, i.e. one layer of the
    # whole pool copied per layer per call. Instead the block is all layers of one kv
    # head, and the kernel indexes [layer, page, rows]; Triton's pointer arithmetic goes
    # 64-bit on its own once the pool passes 4 GiB.
    pool_spec = pl.BlockSpec((layers, None, pages, page_tokens, d), lambda i, h: (0, h // g, 0, 0, 0))
    windowed = not never_windowed(meta.window)
    stream_spec = pl.BlockSpec((n,), lambda i, h: (0,))
    out, lse = pl.pallas_call(
        functools.partial(_prefix_kernel, logits=meta.logits, table_width=table_width, windowed=windowed),
        grid=(n // BLOCK_Q, heads),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h: (0,)),
            stream_spec,
            pl.BlockSpec(meta.prefix_len.shape, lambda i, h: (0,)),
            pl.BlockSpec((meta.page_table.size,), lambda i, h: (0,)),
            pl.BlockSpec((BLOCK_Q, None, d), lambda i, h: (i, h, 0)),
            pool_spec,
            pool_spec,
            *([stream_spec] if windowed else []),
        ],
        out_specs=[
            pl.BlockSpec((BLOCK_Q, None, d), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, BLOCK_Q), lambda i, h: (h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n, heads, d), q.dtype),
            jax.ShapeDtypeStruct((heads, n), jnp.float32),
        ],
        compiler_params=_params(PREFIX_STAGES),
        interpret=_interpret(),
    )(
        jnp.reshape(meta.layer, (1,)).astype(jnp.int32),
        meta.segment_ids.astype(jnp.int32),
        meta.prefix_len.astype(jnp.int32),
        meta.page_table.reshape(-1).astype(jnp.int32),  # [S * P]: one row per segment
        q,
        pool_k,
        pool_v,
        *([first_keys(meta).astype(jnp.int32)] if windowed else []),
    )
    return out, lse.T


# ---- ragged item part ----------------------------------------------------------------------
def _ragged_kernel(start_ref, q_ref, k_ref, v_ref, *refs, logits, windowed):
    """start_ref [n] (each row's item start), q_ref [ITEM_BLOCK, d], k_ref, v_ref [n, d]; then,
    `windowed`, window_ref [1]; then o_ref, lse_ref (as _prefix_kernel: no window, no compare)."""
    window_ref, o_ref, lse_ref = refs if windowed else (None, *refs)
    i = pl.program_id(0)
    q = q_ref[...]  # [ITEM_BLOCK, d]
    bq, d = q.shape
    q_start = start_ref[pl.ds(i * ITEM_BLOCK, ITEM_BLOCK)]  # first stream index of each row's item
    q_pos = i * ITEM_BLOCK + jnp.arange(ITEM_BLOCK)
    # the block's first item starts here, or (later) its first row's window (both >= 0: lax.div)
    first = start_ref[pl.ds(i * ITEM_BLOCK, 1)][0]
    if windowed:
        window = window_ref[0]
        first = jnp.maximum(first, i * ITEM_BLOCK - window + 1)
    first = jax.lax.div(first, ITEM_BLOCK)

    def step(j, carry):
        k = k_ref[pl.ds(j * ITEM_BLOCK, ITEM_BLOCK), :]
        v = v_ref[pl.ds(j * ITEM_BLOCK, ITEM_BLOCK), :]
        s = _scores(plgpu.dot(q, k, trans_b=True, allow_tf32=False), logits, d)
        k_pos = j * ITEM_BLOCK + jnp.arange(ITEM_BLOCK)
        back = q_pos[:, None] - k_pos[None, :]  # how far the key lies before the query
        mask = (k_pos[None, :] >= q_start[:, None]) & (back >= 0)
        if windowed:
            mask &= back < window
        return _online(carry, jnp.where(mask, s, MASK_VALUE), v)

    init = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    out, lse = _finish(*jax.lax.fori_loop(first, i + 1, step, init))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def ragged_item_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    max_item_len: jax.Array | int,
    window: jax.Array | int = NO_WINDOW,
    logits: AttentionLogits = DEFAULT_LOGITS,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of packed items. q: [n, heads, d]; k, v: [n, kv, d]; segment_ids: [n]
    (equal for one item's tokens); window: [] int32 (kernels/paged.py). Returns out [n, heads, d],
    lse [n, heads] float32 (max_item_len unused: the kernel reads where each block's first item starts)."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    if not _tileable_dim(d) or n % ITEM_BLOCK:
        return xla.ragged_item_attention(q, k, v, segment_ids, max_item_len, window, logits)
    g = heads // kv_heads
    windowed = not never_windowed(window)
    out, lse = pl.pallas_call(
        functools.partial(_ragged_kernel, logits=logits, windowed=windowed),
        grid=(n // ITEM_BLOCK, heads),
        in_specs=[
            pl.BlockSpec((n,), lambda i, h: (0,)),
            pl.BlockSpec((ITEM_BLOCK, None, d), lambda i, h: (i, h, 0)),
            pl.BlockSpec((n, None, d), lambda i, h: (0, h // g, 0)),
            pl.BlockSpec((n, None, d), lambda i, h: (0, h // g, 0)),
            *([pl.BlockSpec((1,), lambda i, h: (0,))] if windowed else []),
        ],
        out_specs=[
            pl.BlockSpec((ITEM_BLOCK, None, d), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, ITEM_BLOCK), lambda i, h: (h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((heads, n), jnp.float32)],
        compiler_params=_params(ITEM_STAGES),
        interpret=_interpret(),
    )(segment_starts(segment_ids), q, k, v, *([jnp.reshape(window, (1,)).astype(jnp.int32)] if windowed else []))
    return out, lse.T


# ---- the whole stream ----------------------------------------------------------------------
def paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> jax.Array:
    """A device call's whole stream (kernels/paged.py): the prefix part from the pool, the
    causal part per region, merged by their LSEs. q: [T, heads, d]; k, v: [T, kv, d];
    pool_k, pool_v: [layers, kv, pages, page_tokens, d]. Returns [T, heads, d]."""
    with jax.named_scope("prefix_part"):  # scopes: the parts `bench --profile` reports
        out_p, lse_p = paged_prefix_attention(q, pool_k, pool_v, meta)
    with jax.named_scope("item_part"):
        out_i, lse_i = causal_by_region(ragged_item_attention, q, k, v, meta)
    with jax.named_scope("merge"):
        return merge_attention(out_p, lse_p, out_i, lse_i)
