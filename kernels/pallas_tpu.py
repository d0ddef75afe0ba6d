"""Paged shared-prefix attention as Pallas TPU (Mosaic) kernels: the `pallas_tpu` implementation.

Same functions and shapes as kernels/reference.py, over the paged KV pool and the
segmented token stream of kernels/paged.py. Off TPU the kernels run in Pallas' TPU
interpreter (tests use it on CPU); on a TPU they compile with Mosaic.

Alignment. The engine's planner starts every segment (and the item region, at
`meta.split`) at a multiple of SEGMENT_ALIGN = 128 tokens, so each 128-token query
block belongs to one segment: a block reads one page-table row, chosen per block by
scalar prefetch.

Layout. Queries are regrouped once per call into rows per kv head,
[kv_heads, n * group, d], ordered (token block of ITEM_BLOCK tokens, group, token):
each kv head's query heads form one matmul operand, so grouped-query attention
reads K/V once per kv head and never repeats them. Within a block the token of
row r is `r & (ITEM_BLOCK - 1)` (ITEM_BLOCK is a power of two: no vector division).
Row statistics (max, sum, LSE) are float32 and lane-replicated [rows, 128], the
layout Mosaic keeps in vregs.

Kernels:
- `_prefix_kernel`: grid (kv head, query block, page slot); each step DMAs one
  [page_tokens, d] tile of the pool straight from the block's segment's page
  (the index map reads the page table). Slots at or beyond the segment's
  `prefix_len` are neither fetched (the index map repeats the last valid page, so
  no DMA is issued) nor computed; on a windowed layer neither are the slots before
  the page of the first key any token of the block sees (scalar-prefetch
  `first_page`; the index map holds that page until then), and keys before a row's
  window are masked.
- `_ragged_kernel`: grid (kv head, query block); the stream's K/V of one kv head
  stay in VMEM and an in-kernel loop visits only the key blocks from the block
  where the block's first item starts (scalar-prefetch `first_block`) to the
  diagonal (on a windowed layer, from the block of the first key the block's first
  row's window shows, if later; keys a window hides are masked). Both regions in one
  call: an item never starts before `split`.
- `_merge_kernel`: the exact LSE merge of the two parts.
Shapes a kernel cannot tile (token counts or pages not multiples of 128, head_dim not
a multiple of 64, streams too large for VMEM) fall back to kernels/xla.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from prefixscore.kernels import dispatch, xla
from prefixscore.kernels.paged import (
    DEFAULT_LOGITS,
    NO_WINDOW,
    AttentionLogits,
    PagedAttentionMeta,
    first_keys,
    segment_starts,
)
from prefixscore.kernels.reference import MASK_VALUE

__all__ = [
    "SEGMENT_ALIGN",
    "merge_attention",
    "paged_attention",
    "paged_prefix_attention",
    "ragged_item_attention",
]

LANES = 128
ITEM_BLOCK = 128  # tokens per query / key block (a power of two, a lane width)
# segments start on a query block: one block reads one segment's pages
SEGMENT_ALIGN = ITEM_BLOCK
# the pool holds K/V in the model's dtype (kernels/paged.py: pool_dtype)
POOL_AS_BITS = False
# no short prefill chunks take key steps together (kernels/paged.py: SharedSteps)
SHARED_BLOCK = 0
# K and V of one kv head's whole stream, double-buffered, must fit this share of VMEM
VMEM_STREAM_BYTES = 16 << 20
NT = (((1,), (1,)), ((), ()))  # dot_general dims for q @ k.T


def _interpret() -> pltpu.InterpretParams | bool:
    """Run in the TPU interpreter anywhere but on a TPU (tests on CPU)."""
    return False if dispatch.target_backend() == "tpu" else pltpu.InterpretParams()


def _widen(x: jax.Array, d: int) -> jax.Array:
    """A lane-replicated [rows, 128] statistic to [rows, d]."""
    if d == LANES:
        return x
    if d < LANES:
        return x[:, :d]
    return jnp.tile(x, (1, d // LANES))


def _supported(n: int, d: int) -> bool:
    return n % ITEM_BLOCK == 0 and d % 64 == 0


def _pages_supported(n: int, d: int, page_tokens: int) -> bool:
    # a page is one key tile: its scores [rows, page_tokens] must be whole lane tiles
    return _supported(n, d) and page_tokens % LANES == 0


def _fits_vmem(n: int, d: int, dtype: jnp.dtype) -> bool:
    return 4 * n * d * jnp.dtype(dtype).itemsize <= VMEM_STREAM_BYTES  # K and V, double-buffered


# ---- layout -----------------------------------------------------------------------
def to_rows(x: jax.Array, kv_heads: int) -> jax.Array:
    """[n, heads, d] -> [kv, n * g, d], rows ordered (token block, group, token)."""
    n, heads, d = x.shape
    g = heads // kv_heads
    x = x.reshape(n // ITEM_BLOCK, ITEM_BLOCK, kv_heads, g, d).transpose(2, 0, 3, 1, 4)
    return x.reshape(kv_heads, n * g, d)


def from_rows(x: jax.Array, heads: int) -> jax.Array:
    """Inverse of to_rows: [kv, n * g, d] -> [n, heads, d]."""
    kv_heads, rows, d = x.shape
    g = heads // kv_heads
    n = rows // g
    x = x.reshape(kv_heads, n // ITEM_BLOCK, g, ITEM_BLOCK, d).transpose(1, 3, 0, 2, 4)
    return x.reshape(n, heads, d)


def lse_from_rows(lse: jax.Array, heads: int) -> jax.Array:
    """[kv, n * g, 128] lane-replicated -> [n, heads]."""
    return from_rows(lse[..., :1], heads)[..., 0]


# ---- prefix part (paged) -------------------------------------------------------------
def _prefix_kernel(
    seg_ref,
    table_ref,
    len_ref,
    layer_ref,
    first_ref,
    q_ref,
    low_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    m_sc,
    l_sc,
    acc_sc,
    *,
    logits,
    group,
    steps,
):
    del table_ref, layer_ref  # only the index maps read the page table and the layer
    i, j = pl.program_id(1), pl.program_id(2)
    page_tokens = k_ref.shape[0]
    length = len_ref[seg_ref[i]]  # prefix keys of this query block's segment

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((j * page_tokens < length) & (j >= first_ref[i]))
    def _step():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]  # [R, d], [page_tokens, d], [page_tokens, d]
        raw = jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32)  # [R, page_tokens]
        s = logits.apply(raw, q.shape[1])
        # only the segment's last page is partly filled, and only pages at the block's windows'
        # start are partly before them; other pages pass the tests whole
        col = j * page_tokens + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        low = jnp.tile(low_ref[...], (group, page_tokens // LANES))  # [R, page_tokens]: row r's token r & 127
        s = jnp.where((col < length) & (col >= low), s, MASK_VALUE)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 128]
        p = jnp.exp(s - jnp.tile(m_next, (1, page_tokens // LANES)))
        alpha = jnp.exp(m_prev - m_next)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_next
        pv = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, d]
        acc_sc[...] = acc_sc[...] * _widen(alpha, acc_sc.shape[1]) + pv

    @pl.when(j == steps - 1)
    def _finish():
        total, m = l_sc[...], m_sc[...]
        # no step ran (prefix_len 0, or all before the windows): out 0 and an LSE the merge weighs
        # exp(-huge) = 0 (a row whose steps all were before its window: about MASK_VALUE too)
        empty = total == 0.0
        safe = jnp.where(empty, 1.0, total)
        o_ref[...] = (acc_sc[...] / _widen(safe, acc_sc.shape[1])).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, MASK_VALUE, m + jnp.log(safe))


def paged_prefix_rows(q_rows: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta, group: int):
    """The prefix part on row layout. q_rows: [kv, T * g, d]; pool_k, pool_v:
    [layers, kv, pages, page_tokens, d]. Returns out [kv, T * g, d] and lse
    [kv, T * g, 128] float32 (lane-replicated)."""
    kv_heads, rows, d = q_rows.shape
    page_tokens = pool_k.shape[3]
    slots = meta.page_table.shape[1]  # P: pages per segment, one grid step each
    r = group * ITEM_BLOCK
    low = first_keys(meta)  # [T]: the first key each token sees
    first_page = jax.lax.div(jnp.min(low.reshape(-1, ITEM_BLOCK), axis=1), page_tokens)  # [T / 128]

    def kv_map(h, i, j, seg_ref, table_ref, len_ref, layer_ref, first_ref):
        seg = seg_ref[i]
        # past the prefix, repeat the last real page, and before the block's first visible page
        # fetch that one: Pallas skips the copy of an unchanged block.
        # lax.div: lengths are non-negative, and `//` lowers through sign(), which Mosaic
        # resolves against the chip it runs on
        last = jnp.maximum(jax.lax.div(len_ref[seg] + page_tokens - 1, page_tokens) - 1, 0)
        return (layer_ref[0], h, table_ref[seg * slots + jnp.minimum(jnp.maximum(j, first_ref[i]), last)], 0, 0)

    row_map = lambda h, i, j, *_: (h, i, 0)
    kernel = functools.partial(_prefix_kernel, logits=meta.logits, group=group, steps=slots)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(kv_heads, rows // r, slots),
            in_specs=[
                pl.BlockSpec((None, r, d), row_map),
                pl.BlockSpec((ITEM_BLOCK, LANES), lambda h, i, j, *_: (i, 0)),
                pl.BlockSpec((None, None, None, page_tokens, d), kv_map),
                pl.BlockSpec((None, None, None, page_tokens, d), kv_map),
            ],
            out_specs=[
                pl.BlockSpec((None, r, d), row_map),
                pl.BlockSpec((None, r, LANES), row_map),
            ],
            scratch_shapes=[
                pltpu.VMEM((r, LANES), jnp.float32),
                pltpu.VMEM((r, LANES), jnp.float32),
                pltpu.VMEM((r, d), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((kv_heads, rows, d), q_rows.dtype),
            jax.ShapeDtypeStruct((kv_heads, rows, LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret(),
    )(
        meta.segment_ids[::ITEM_BLOCK].astype(jnp.int32),  # [T / 128]: one segment per query block
        meta.page_table.reshape(-1).astype(jnp.int32),  # [S * P]: SMEM holds 1-D arrays compactly
        meta.prefix_len.astype(jnp.int32),  # [S]
        jnp.reshape(meta.layer, (1,)).astype(jnp.int32),  # [1]
        first_page.astype(jnp.int32),  # [T / 128]: the first page slot a block's windows show
        q_rows,
        jnp.broadcast_to(low[:, None], (low.shape[0], LANES)),  # [T, 128]
        pool_k,
        pool_v,
    )


def paged_prefix_attention(
    q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> tuple[jax.Array, jax.Array]:
    """Every token against its segment's prefix pages (kernels/paged.py). q: [T, heads, d];
    pool_k, pool_v: [layers, kv, pages, page_tokens, d]. Returns out [T, heads, d] and lse
    [T, heads] float32 (<= MASK_VALUE / 2, out 0, where the segment's prefix_len is 0)."""
    n, heads, d = q.shape
    kv_heads = pool_k.shape[1]
    if not _pages_supported(n, d, pool_k.shape[3]):
        return xla.paged_prefix_attention(q, pool_k, pool_v, meta)
    out, lse = paged_prefix_rows(to_rows(q, kv_heads), pool_k, pool_v, meta, heads // kv_heads)
    return from_rows(out, heads), lse_from_rows(lse, heads)


# ---- ragged item part ----------------------------------------------------------------
def _ragged_kernel(first_ref, window_ref, q_ref, start_ref, k_ref, v_ref, o_ref, lse_ref, *, group, logits):
    i = pl.program_id(1)
    q = q_ref[...]  # [R, d], R = group * ITEM_BLOCK
    rows, d = q.shape
    # [R, 128]: the first stream index the row sees: its item's start, or its window's
    q_start = jnp.tile(start_ref[...], (group, 1))
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, ITEM_BLOCK), 0)
    q_pos = i * ITEM_BLOCK + (row & (ITEM_BLOCK - 1))

    def step(j, carry):
        m_prev, l_prev, acc = carry
        at = pl.multiple_of(j * ITEM_BLOCK, ITEM_BLOCK)
        k = k_ref[pl.ds(at, ITEM_BLOCK), :]
        v = v_ref[pl.ds(at, ITEM_BLOCK), :]
        s = logits.apply(jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32), d)  # [R, 128]
        k_pos = at + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        visible = (k_pos >= q_start) & (k_pos <= q_pos) & (q_pos - k_pos < window_ref[0])
        s = jnp.where(visible, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_next)
        alpha = jnp.exp(m_prev - m_next)
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        acc = acc * _widen(alpha, d) + jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_next, l_next, acc

    init = (
        jnp.full((rows, LANES), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, LANES), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )
    m, total, acc = jax.lax.fori_loop(first_ref[i], i + 1, step, init)
    o_ref[...] = (acc / _widen(total, d)).astype(o_ref.dtype)  # total >= exp(0): every row sees itself
    lse_ref[...] = m + jnp.log(total)


def ragged_rows(
    q_rows: jax.Array,
    k: jax.Array,
    v: jax.Array,
    starts: jax.Array,
    group: int,
    window: jax.Array | int = NO_WINDOW,
    logits: AttentionLogits = DEFAULT_LOGITS,
):
    """The item part on row layout. q_rows: [kv, n * g, d]; k, v: [n, kv, d]; starts: [n], the
    stream index where each token's item starts; window: [] int32 (kernels/paged.py).
    Returns out [kv, n * g, d] and lse [kv, n * g, 128] float32."""
    kv_heads, rows, d = q_rows.shape
    n = k.shape[0]
    r = group * ITEM_BLOCK
    window = jnp.reshape(window, (1,)).astype(jnp.int32)
    # [n / 128]: the first key block each query block needs: where its first item starts, or
    # (later, on a windowed layer) the first key its first row's window shows
    first = jnp.maximum(starts[::ITEM_BLOCK], jnp.arange(0, n, ITEM_BLOCK, dtype=jnp.int32) - window + 1)
    start_lanes = jnp.broadcast_to(starts[:, None], (n, LANES))  # [n, 128]
    kt, vt = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [kv, n, d]
    kernel = functools.partial(_ragged_kernel, group=group, logits=logits)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(kv_heads, n // ITEM_BLOCK),
            in_specs=[
                pl.BlockSpec((None, r, d), lambda h, i, *_: (h, i, 0)),
                pl.BlockSpec((ITEM_BLOCK, LANES), lambda h, i, *_: (i, 0)),
                # the whole stream of one kv head: fetched once per head, sliced in the kernel
                pl.BlockSpec((None, n, d), lambda h, i, *_: (h, 0, 0)),
                pl.BlockSpec((None, n, d), lambda h, i, *_: (h, 0, 0)),
            ],
            out_specs=[
                pl.BlockSpec((None, r, d), lambda h, i, *_: (h, i, 0)),
                pl.BlockSpec((None, r, LANES), lambda h, i, *_: (h, i, 0)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((kv_heads, rows, d), q_rows.dtype),
            jax.ShapeDtypeStruct((kv_heads, rows, LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=2 * VMEM_STREAM_BYTES
        ),
        interpret=_interpret(),
    )(jax.lax.div(first, ITEM_BLOCK), window, q_rows, start_lanes, kt, vt)


def ragged_item_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    max_item_len: jax.Array | int,
    window: jax.Array | int = NO_WINDOW,
    logits: AttentionLogits = DEFAULT_LOGITS,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of packed items. q: [n, heads, d]; k, v: [n, kv, d]; segment_ids: [n];
    window: [] int32 (kernels/paged.py). Returns out [n, heads, d], lse [n, heads] float32.
    max_item_len is not needed: the kernel finds each block's first item from the segment ids."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    if not (_supported(n, d) and _fits_vmem(n, d, k.dtype)):
        return xla.ragged_item_attention(q, k, v, segment_ids, max_item_len, window, logits)
    starts = segment_starts(segment_ids)
    out, lse = ragged_rows(to_rows(q, kv_heads), k, v, starts, heads // kv_heads, window, logits)
    return from_rows(out, heads), lse_from_rows(lse, heads)


# ---- merge ---------------------------------------------------------------------------
def _merge_kernel(oa_ref, la_ref, ob_ref, lb_ref, o_ref):
    la, lb = la_ref[...], lb_ref[...]  # [R, 128]
    m = jnp.maximum(la, lb)
    wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
    d = o_ref.shape[-1]
    merged = oa_ref[...].astype(jnp.float32) * _widen(wa, d) + ob_ref[...].astype(jnp.float32) * _widen(wb, d)
    o_ref[...] = (merged / _widen(wa + wb, d)).astype(o_ref.dtype)


def merge_rows(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array, block: int) -> jax.Array:
    """Merge on row layout: out_* [kv, rows, d], lse_* [kv, rows, 128] -> [kv, rows, d]."""
    kv_heads, rows, d = out_a.shape
    out_spec = pl.BlockSpec((None, block, d), lambda h, i: (h, i, 0))
    lse_spec = pl.BlockSpec((None, block, LANES), lambda h, i: (h, i, 0))
    return pl.pallas_call(
        _merge_kernel,
        grid=(kv_heads, rows // block),
        in_specs=[out_spec, lse_spec, out_spec, lse_spec],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_a.shape, out_a.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret(),
    )(out_a, lse_a, out_b, lse_b)


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Exact LSE merge. out_*: [..., heads, d]; lse_*: [..., heads] float32 -> [..., heads, d]."""
    *lead, heads, d = out_a.shape
    rows = math.prod(lead) * heads
    if rows % 8 or d % 64:
        return xla.merge_attention(out_a, lse_a, out_b, lse_b)
    flat = lambda o: o.reshape(1, rows, d)
    lanes = lambda s: jnp.broadcast_to(s.reshape(1, rows, 1), (1, rows, LANES))
    block = next(b for b in (512, 256, 128, 64, 32, 16, 8) if rows % b == 0)
    out = merge_rows(flat(out_a), lanes(lse_a), flat(out_b), lanes(lse_b), block)
    return out.reshape(out_a.shape)


# ---- composite -------------------------------------------------------------------------
def paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> jax.Array:
    """A device call's whole stream (kernels/paged.py): q [T, heads, d]; k, v [T, kv, d]; pool_k,
    pool_v [layers, kv, pages, page_tokens, d] -> [T, heads, d]. Prefix part, item part and
    merge stay in row layout: the queries are regrouped once and the output once."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    if not (_pages_supported(n, d, pool_k.shape[3]) and _fits_vmem(n, d, k.dtype) and meta.split % SEGMENT_ALIGN == 0):
        return xla.paged_attention(q, k, v, pool_k, pool_v, meta)
    group = heads // kv_heads
    q_rows = to_rows(q, kv_heads)  # [kv, T * g, d]
    with jax.named_scope("prefix_part"):  # scopes: the parts `bench --profile` reports
        out_p, lse_p = paged_prefix_rows(q_rows, pool_k, pool_v, meta, group)
    # The causal part of both regions in one call, not one per region (causal_by_region):
    # an item starting at `split` at the latest, the kernel's loop for an item-region block
    # never reaches back into the prefill chunks, so short items already skip their blocks,
    # and no row slices of the regions are copied out and concatenated back.
    with jax.named_scope("item_part"):
        starts = segment_starts(meta.item_ids, meta.split)
        out_i, lse_i = ragged_rows(q_rows, k, v, starts, group, meta.window, meta.logits)
    with jax.named_scope("merge"):
        return from_rows(merge_rows(out_p, lse_p, out_i, lse_i, group * ITEM_BLOCK), heads)
