"""Shared-prefix attention in plain XLA, shaped for CPUs (the `xla` implementation).

Same functions and shapes as kernels/reference.py. The reference materialises
every score matrix at once ([heads, n, s] floats: hundreds of MB for a batch of
items over a 2k-token prefix), so on a CPU it runs at memory speed. Here the
work is tiled so the working set of one step stays in cache, and loops whose
trip count is a runtime value skip the padding of a bucket entirely:

- prefix part: per contiguous run of a segment, query blocks starting at the
  run's first token (no alignment needed) x chunks of the segment's pages
  gathered from the pool (an online softmax over the chunks its prefix fills):
  cost follows the real prefix length; an item's steps follow its prefix's length
  alone (whole chunks unmasked, then finer masked steps);
- prefill chunks: their K/V is in the pool before attention runs (the call writes
  it first), so a chunk's whole attention is its prefix part extended to each
  token's own position, in steps at fixed multiples of K_TAIL keys: no causal part,
  no merge (a W4 call's attention takes 0.7x the time it took with a causal part per chunk);
  short chunks whose first pages are the same (lm-eval's sibling choices over one k-shot header)
  take those key steps once, in one 64-token block for the group, as more trips of the runs' own
  loop (no second copy of the step in the program), then each chunk its own steps from the
  running softmax that block left in its rows; the planner says which chunks group
  (kernels/paged.py SharedSteps), so the program computes no plan;
- ragged item part (the item region): short items (the common case) in one masked
  softmax over each token's 33 keys ending at itself (the scores from one matmul against
  two 32-token blocks, the values summed in order of distance); longer ones per 64-token
  query block from the item's own first token, over the key blocks from that start to the
  diagonal (a runtime trip count);
- the merge: one fused elementwise pass.
Sliding windows (kernels/paged.py): in a model with a sliding layer, each prefix block starts
its steps at the K_TAIL step of the first key any of its rows needs (key 0 on a full layer) and
masks every step (the block's rows span few positions, the window many: little is computed in
vain); the item part's long-item blocks start at the first key block the window shows, and an
item takes the short items' path only where the window is no shorter than it (it then hides
nothing).
The same bits whatever rides beside: a token's reductions are laid out by its own position
(in its item, its prefix, its query), never by its neighbours or the call's shape: how its
item is computed follows the item's own length, a long item's blocks start at its own first
token, a prefix's steps follow its length or the row's position, and a sum over keys never runs
over offsets that follow where the token sits among its neighbours: a matrix library may pair or
split its contraction by offset, so exact zeros for the keys a row does not see are not enough
(docs/design.md, "The same answer whatever the call").
A soft cap (AttentionLogits) is applied to the scaled scores before the masks.
Compile time: each query block size and key step is a copy of the step in the program, and
those copies, not the model, are most of a small executable's compile time. So only the
query blocks a bucket's runs can reach are compiled, a rest that needs a whole Q_BLOCK block
takes one more trip of the Q_BLOCK loop (no second copy of that block under the rest's branch:
12-14% fewer instructions in a test model's executables), the masked key steps share one loop
body, and a model with a sliding layer compiles one set of steps, not a windowed and a plain
one under a branch (a compare and a select per score, against two matmuls).
Row sums of the softmax come out of the PV matmul (a ones column appended to V)
rather than a separate reduction over the probabilities.

Grouped-query attention reshapes the query heads to [kv_heads, group]; K/V are
never repeated. Softmax statistics, LSE and the merge are float32.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from prefixscore.kernels.paged import (
    DEFAULT_LOGITS,
    NO_WINDOW,
    AttentionLogits,
    PagedAttentionMeta,
    first_keys,
    from_pool,
    never_windowed,
    segment_runs,
)
from prefixscore.kernels.reference import MASK_VALUE, merge_attention

__all__ = ["merge_attention", "paged_attention", "paged_prefix_attention", "ragged_item_attention"]

# a row's bits do not depend on where it sits in its call (module docstring): the start-up check
# (kernels/selfcheck.py) holds this implementation to that on the machine it serves from
SAME_BITS_ANYWHERE = True
# the CPU loops start a query block at any token, so segments need no alignment (prefill
# chunks of short queries pack back to back; a long query's chunks fall on block boundaries
# anyway, being whole multiples of them)
SEGMENT_ALIGN = 1
# a 16-bit float model's pool holds its K/V bits as uint16 (kernels/paged.py: pool_dtype): XLA:CPU
# would convert the whole pool to float32 around every page gather and pool write
POOL_AS_BITS = True

# Tile sizes (measured on a 2-core Sapphire Rapids, docs/benchmarks.md): a [kv, Q_BLOCK * group,
# K_CHUNK] float32 score tile is a few MB; 32-token item blocks keep the item part's
# wasted pairs (keys of a neighbouring item) small for short items.
Q_BLOCK = 256
K_CHUNK = 1024
# a segment's last query tokens and a prefix's last keys go in finer steps: short segments and
# short prefixes (many small requests) would otherwise pad each to a whole block. A run's rest
# (< Q_BLOCK tokens) is ONE block of the smallest of Q_TAILS that holds it, and a prefix's rest
# (< K_CHUNK keys) K_TAIL-key steps then one step of K_TAIL or K_TAIL / 2: each loop step costs
# a fixed overhead on XLA:CPU, so on W4-like calls (200-token runs over 300-token prefixes)
# one 256-token block and 256 + 128 keys run 1.5x faster than 64-token blocks and 512 keys
Q_TAILS = (64, 128, 256)
K_TAIL = 256
ITEM_BLOCK = 32
# longer items: 64-token blocks from each block's first item to the diagonal (on W2-like items
# of 5-200 tokens, 32% faster than 128-token blocks). Prefill chunks do not come here on CPU:
# paged_attention reads them back from the pool (paged_prefix_rows' causal runs)
LONG_ITEM_BLOCK = 64
# a group of short prefill chunks that read the same pages first (kernels/paged.py: SharedSteps)
# takes those key steps in one block of this many tokens: the smallest query block, which holds
# the group's chunks (the planner groups chunks within it)
SHARED_BLOCK = Q_TAILS[0]


def _with_ones(v: jax.Array) -> jax.Array:
    """Append a column of ones to values [..., d]: p @ [V, 1] yields the softmax row sums
    with the output in the same matmul, saving a reduction pass over p."""
    return jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)


def _online_step(
    carry: tuple[jax.Array, jax.Array],
    scores: jax.Array,
    v1: jax.Array,
    scale: float,
    spec: str,
) -> tuple[jax.Array, jax.Array]:
    """One online-softmax step. carry: running max m [..., q] (of scaled scores) and
    acc [..., q, d + 1] (output and row sum, float32); scores [..., q, c] raw q.k in float32
    (masked entries MASK_VALUE, scale > 0 so the max of raw scores is the max of scaled ones);
    v1: the chunk's values with a ones column. The probabilities stay float32 in the PV product
    (a no-op for float32 models; for bfloat16 ones, rounding them to bf16 there moves a real
    model's scores by ~3e-2, more than all other bf16 rounding together)."""
    m, acc = carry
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1) * scale)
    # at most 0 in exact arithmetic. Compiled by XLA:CPU's classic emitters, some exponents came out
    # positive and huge (Gemma 2 without its soft cap, long items: exp overflowed and the scores
    # were NaN), though materialising the scaled scores and taking the max of those did not change
    # it; clamped at 0, each exponent is the exact one however the compiler evaluates the row's max,
    # and those scores equal transformers' to 2e-9
    p = jnp.exp(jnp.minimum(scores * scale - m_new[..., None], 0.0))
    pv = jnp.einsum(spec, p, v1.astype(jnp.float32), preferred_element_type=jnp.float32)
    return m_new, acc * jnp.exp(m - m_new)[..., None] + pv


def _logits(raw: jax.Array, logits: AttentionLogits, d: int) -> tuple[jax.Array, float]:
    """Raw scores q.k -> (the scores to mask, the scale _online_step applies to them). Without a
    soft cap the scale stays in _online_step's exponent (no extra pass); a cap needs it first."""
    if logits.softcap is None:
        return raw, logits.scale_for(d)
    return logits.apply(raw, d), 1.0


def _finish(m: jax.Array, acc: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Normalise acc [..., d + 1]; a row that saw no key (sum 0) gives output 0 and LSE MASK_VALUE,
    which the merge weighs 0."""
    total = acc[..., -1]
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    out = acc[..., :-1] / safe[..., None]
    return out.astype(dtype), jnp.where(empty, MASK_VALUE, m + jnp.log(safe))


# ---- row layout: [kv, n * group, d], row = token * group + head-in-group ------------------------
# Both parts and the merge work on this layout, so a call regroups its queries once and
# its output once; blocks of tokens are contiguous rows (reshapes, not copies).
def to_rows(x: jax.Array, kv_heads: int) -> jax.Array:
    """[n, heads, d] -> [kv, n * g, d]."""
    n, heads, d = x.shape
    g = heads // kv_heads
    return x.reshape(n, kv_heads, g, d).transpose(1, 0, 2, 3).reshape(kv_heads, n * g, d)


def from_rows(x: jax.Array, heads: int) -> jax.Array:
    """[kv, n * g, d] -> [n, heads, d]."""
    kv_heads, rows, d = x.shape
    g = heads // kv_heads
    return x.reshape(kv_heads, rows // g, g, d).transpose(1, 0, 2, 3).reshape(rows // g, heads, d)


def lse_from_rows(lse: jax.Array, heads: int) -> jax.Array:
    """[kv, n * g] -> [n, heads]."""
    return from_rows(lse[..., None], heads)[..., 0]


def dense_masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, visible: Callable[[jax.Array, jax.Array], jax.Array]
) -> jax.Array:
    """Every query against every key under a mask, tiled like the prefix part (no block skipped).

    q: [n, heads, d]; k, v: [n, kv_heads, d] (n a multiple of Q_BLOCK); visible(q_idx [r],
    k_idx [c]) -> bool [r, c]. Returns [n, heads, d]. Serves the `packed` baseline: dense
    O(n^2) work as packing implies, at the same tiling efficiency as the fast path.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    r, chunk = Q_BLOCK * g, min(K_CHUNK, n)
    scale = d**-0.5
    qr = to_rows(q, kv_heads)
    kt, vt1 = k.transpose(1, 0, 2), _with_ones(v.transpose(1, 0, 2))
    token = jnp.repeat(jnp.arange(Q_BLOCK), g)  # row -> token within its block

    def block(b: jax.Array, out: jax.Array) -> jax.Array:
        qblk = jax.lax.dynamic_slice_in_dim(qr, b * r, r, axis=1)
        q_idx = b * Q_BLOCK + token

        def step(j: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            kc = jax.lax.dynamic_slice_in_dim(kt, j * chunk, chunk, axis=1)
            vc = jax.lax.dynamic_slice_in_dim(vt1, j * chunk, chunk, axis=1)
            sc = jnp.einsum("kqd,kcd->kqc", qblk, kc, preferred_element_type=jnp.float32)
            sc = jnp.where(visible(q_idx, j * chunk + jnp.arange(chunk))[None], sc, MASK_VALUE)
            return _online_step(carry, sc, vc, scale, "kqc,kcd->kqd")

        init = (jnp.full((kv_heads, r), MASK_VALUE, jnp.float32), jnp.zeros((kv_heads, r, d + 1), jnp.float32))
        res, _ = _finish(*jax.lax.fori_loop(0, n // chunk, step, init), jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, res, b * r, axis=1)

    out = jax.lax.fori_loop(0, n // Q_BLOCK, block, jnp.zeros((kv_heads, n * g, d), jnp.float32))
    return from_rows(out, heads).astype(q.dtype)


def ragged_rows(
    qr: jax.Array,
    kt: jax.Array,
    vt1: jax.Array,
    segment_ids: jax.Array,
    max_item_len: jax.Array | int,
    group: int,
    long_block: int = LONG_ITEM_BLOCK,
    window: jax.Array | int = NO_WINDOW,
    logits: AttentionLogits = DEFAULT_LOGITS,
) -> tuple[jax.Array, jax.Array]:
    """Item part on rows. qr: [kv, n * g, d]; kt: [kv, n, d]; vt1: [kv, n, d + 1]; segment_ids: [n]
    (each item's own id, negative for padding; n a multiple of long_block, its last long_block
    tokens padding: room for a long item's last block). Which way an item is computed is the item's
    own business, never the call's, so its bits never depend on what rides beside it:
    - a short item (at most ITEM_BLOCK + 1 tokens, and, in a layer with a window, none shorter
      than the item): each token in one softmax over the ITEM_BLOCK + 1 keys ending at itself,
      its values summed in order of distance (_two_blocks), so where the item sits in its blocks
      changes no term's place in any sum;
    - a longer item: query blocks of long_block tokens from the item's own first token, each over
      key blocks from the same start to the diagonal (_long_items), so each token's keys fall into
      the same steps wherever the item is placed. Only a call holding such an item (max_item_len,
      a runtime bound) runs them.
    Returns out [kv, n * g, d], lse [kv, n * g] (float32)."""
    n = kt.shape[1]
    short = min(ITEM_BLOCK, n)
    blk = min(long_block, n)
    # no layer slides: no window mask; else the layer's window (a full layer's NO_WINDOW masks nothing)
    layer_window = None if never_windowed(window) else jnp.asarray(window)
    starts, ends, _ = segment_runs(segment_ids, n)
    lengths = ends - starts
    is_item = (starts < n) & (segment_ids[jnp.minimum(starts, n - 1)] >= 0)  # padding's ids are negative
    longer = lengths > short + 1
    if layer_window is not None:  # a window shorter than an item hides keys the two blocks would see
        longer |= lengths > layer_window
    longer &= is_item
    n_long = jnp.sum(longer)
    # a call whose items are all long (embeddings, rerank documents) skips the short items' pass
    # over the whole stream: its rows are then the long pass's or padding's. Which pass computes
    # an item is the item's own business, so whether the short pass runs moves no bit of any item
    short_items = jnp.any(is_item & ~longer)
    parts = jax.lax.cond(
        short_items,
        lambda: _two_blocks(qr, kt, vt1, segment_ids, group, short, logits),
        lambda: (jnp.zeros(qr.shape, jnp.float32), jnp.full(qr.shape[:2], MASK_VALUE, jnp.float32)),
    )

    def with_long(parts: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        (at,) = jnp.nonzero(longer, size=n // (short + 2) + 1, fill_value=0)
        return _long_items(qr, kt, vt1, starts[at], lengths[at], n_long, group, blk, logits, layer_window, parts)

    bound = jnp.asarray(max_item_len)
    maybe_long = bound > short + 1
    if layer_window is not None:
        maybe_long |= bound > layer_window
    return jax.lax.cond(maybe_long & (n_long > 0), with_long, lambda parts: parts, parts)


def _band(x: jax.Array, blk: int, g: int) -> jax.Array:
    """[kv, nb, blk * g, 2 * blk] (row t * g + h against the two blocks' keys) -> [kv, nb, blk, g,
    blk + 1]: column r of token t is key t + r of the two blocks, the keys from blk before the
    token to the token itself. A row of t's is read at a stride one longer than the rows' (the
    classic skew: reshapes, a pad and slices, no gather)."""
    kv_heads, nb, _, width = x.shape
    row = g * width
    flat = x.reshape(kv_heads, nb, blk * row)
    skewed = jnp.pad(flat, ((0, 0), (0, 0), (0, blk))).reshape(kv_heads, nb, blk, row + 1)[..., :row]
    return skewed.reshape(kv_heads, nb, blk, g, width)[..., : blk + 1]


def _two_blocks(
    qr: jax.Array, kt: jax.Array, vt1: jax.Array, segment_ids: jax.Array, g: int, blk: int, logits: AttentionLogits
) -> tuple[jax.Array, jax.Array]:
    """Short items: block j's queries against blocks j - 1 and j side by side (one matmul over the
    head dimension), then each token's blk + 1 keys that end at itself, the only ones a short
    item's token can see (_band). The values are summed over those keys in the order of their
    distance from the token, one term at a time: a product over the two blocks' keys would sum
    them at offsets that follow where the item sits in its blocks, and a matrix library may pair
    or split its contraction by offset (XLA:CPU's dots on an AMD Zen 4 sum a key at an odd offset
    apart from one at an even offset: a short item's bits moved with its placement)."""
    kv_heads, rows, d = qr.shape
    n = kt.shape[1]
    nb = n // blk
    qx = qr.reshape(kv_heads, nb, blk * g, d)
    kx = kt.reshape(kv_heads, nb, blk, d)
    vx = vt1.reshape(kv_heads, nb, blk, d + 1)
    seg = segment_ids.reshape(nb, blk)
    q_seg = jnp.repeat(seg, g, axis=1)[None, :, :, None]  # [1, nb, blk*g, 1] (row r = token r // g)

    def prev(x: jax.Array, fill: int) -> jax.Array:  # block j-1 at j (block -1: `fill`, masked)
        return jnp.concatenate([jnp.full_like(x[:, :1], fill), x[:, :-1]], axis=1)

    keys = jnp.concatenate([prev(kx, 0), kx], axis=2)
    vals = jnp.concatenate([prev(vx, 0), vx], axis=2).astype(jnp.float32)
    k_seg = jnp.concatenate([prev(seg[None], -2)[0], seg], axis=1)[None, :, None, :]
    sc, scale = _logits(jnp.einsum("kbqd,kbcd->kbqc", qx, keys, preferred_element_type=jnp.float32), logits, d)
    # the band holds no key past its token (causal by construction): only other items' keys to mask
    band = _band(jnp.where(k_seg == q_seg, sc, MASK_VALUE), blk, g)  # [kv, nb, blk, g, blk + 1]
    # _online_step's arithmetic from its empty carry (running max MASK_VALUE, sums 0)
    m = jnp.maximum(MASK_VALUE, jnp.max(band, axis=-1) * scale)
    p = jnp.exp(jnp.minimum(band * scale - m[..., None], 0.0))
    acc = p[..., 0, None] * vals[:, :, :blk, None]
    for r in range(1, blk + 1):  # token t's key t + r of the two blocks: values rows r..r + blk
        acc = acc + p[..., r, None] * vals[:, :, r : r + blk, None]
    out, lse = _finish(m.reshape(kv_heads, nb, blk * g), acc.reshape(kv_heads, nb, blk * g, d + 1), jnp.float32)
    return out.reshape(kv_heads, rows, d), lse.reshape(kv_heads, rows)


def _long_items(
    qr: jax.Array,
    kt: jax.Array,
    vt1: jax.Array,
    item_starts: jax.Array,
    item_lengths: jax.Array,
    count: jax.Array,
    g: int,
    blk: int,
    logits: AttentionLogits,
    window: jax.Array | None,
    parts: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """The first `count` of the items at item_starts [m] (lengths [m]): each in query blocks of
    `blk` tokens from its own first token, block b over the key blocks from the item's start
    (with a window (None: none), from the block of the first key its first row sees) to its
    diagonal, masked by causality (and the window). Block and key steps are offsets within the
    item: the same steps wherever the item sits in the stream. parts: the short items' out
    [kv, n * g, d] and lse [kv, n * g]; returned with the long items' rows written over them
    (written in place: no second pass merging the two)."""
    kv_heads, _, d = qr.shape
    r = blk * g
    token = jnp.repeat(jnp.arange(blk, dtype=jnp.int32), g)  # row -> token within its block
    Outs = tuple[jax.Array, jax.Array]

    def item(i: jax.Array, outs: Outs) -> Outs:
        start, length = item_starts[i], item_lengths[i]

        def block(b: jax.Array, outs: Outs) -> Outs:
            q_off = b * blk + token  # [r] offsets within the item
            qblk = jax.lax.dynamic_slice_in_dim(qr, (start + b * blk) * g, r, axis=1)
            first = 0 if window is None else jnp.maximum(b * blk - window + 1, 0) // blk

            def step(j: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                kc = jax.lax.dynamic_slice_in_dim(kt, start + j * blk, blk, axis=1)
                vc = jax.lax.dynamic_slice_in_dim(vt1, start + j * blk, blk, axis=1)
                back = q_off[:, None] - (j * blk + jnp.arange(blk, dtype=jnp.int32))[None, :]  # [r, blk]
                visible = back >= 0  # a row of the item sees only the item's keys before it
                if window is not None:
                    visible &= back < window
                sc, scale = _logits(jnp.einsum("kqd,kcd->kqc", qblk, kc, preferred_element_type=jnp.float32), logits, d)
                return _online_step(carry, jnp.where(visible[None], sc, MASK_VALUE), vc, scale, "kqc,kcd->kqd")

            init = (jnp.full((kv_heads, r), MASK_VALUE, jnp.float32), jnp.zeros((kv_heads, r, d + 1), jnp.float32))
            out, lse = _finish(*jax.lax.fori_loop(first, b + 1, step, init), jnp.float32)
            mine = q_off < length  # rows past the item (the last block overhangs it) are left as they were
            at = (start + b * blk) * g
            old_out = jax.lax.dynamic_slice_in_dim(outs[0], at, r, axis=1)
            old_lse = jax.lax.dynamic_slice_in_dim(outs[1], at, r, axis=1)
            return (
                jax.lax.dynamic_update_slice_in_dim(outs[0], jnp.where(mine[None, :, None], out, old_out), at, axis=1),
                jax.lax.dynamic_update_slice_in_dim(outs[1], jnp.where(mine[None], lse, old_lse), at, axis=1),
            )

        return jax.lax.fori_loop(0, (length + blk - 1) // blk, block, outs)

    return jax.lax.fori_loop(0, count, item, parts)


def _ragged_inputs(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, multiple: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A stream laid out per kv head, padded to a multiple of `multiple` tokens and then one
    `multiple` more (padding: segment -1, no item's): queries as rows [kv, n * g, d], keys
    [kv, n, d], values with a ones column [kv, n, d + 1]. The block of room past the stream lets a
    long item's last block overhang its end unclamped. Each is padded after its transpose: XLA:CPU
    fuses the two into one copy (a pad before it is a second copy of the stream)."""
    kv_heads = k.shape[1]
    room = -k.shape[0] % multiple + multiple

    def padded(x: jax.Array, per_token: int) -> jax.Array:
        return jnp.pad(x, ((0, 0), (0, room * per_token), (0, 0)))

    qr = padded(to_rows(q, kv_heads), q.shape[1] // kv_heads)
    kt, vt = padded(k.transpose(1, 0, 2), 1), padded(v.transpose(1, 0, 2), 1)
    return qr, kt, _with_ones(vt), jnp.pad(segment_ids, (0, room), constant_values=-1)


def ragged_item_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    max_item_len: jax.Array | int,
    window: jax.Array | int = NO_WINDOW,
    logits: AttentionLogits = DEFAULT_LOGITS,
    long_block: int = LONG_ITEM_BLOCK,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of items packed back to back in one stream (see reference.ragged_item_attention
    and ragged_rows). q: [n, heads, d]; k, v: [n, kv_heads, d]; segment_ids: [n]; max_item_len:
    int32 scalar >= every item's length; window: [] int32 (kernels/paged.py).
    Returns out [n, heads, d] and lse [n, heads] float32."""
    n, heads, _ = q.shape
    kv_heads = k.shape[1]
    qr, kt, vt1, seg = _ragged_inputs(q, k, v, segment_ids, long_block)
    out, lse = ragged_rows(qr, kt, vt1, seg, max_item_len, heads // kv_heads, long_block, window, logits)
    return from_rows(out, heads)[:n].astype(q.dtype), lse_from_rows(lse, heads)[:n]


def _segment_chunk(
    flat_pool: jax.Array, index: jax.Array, pages: jax.Array, kv_heads: int, page_tokens: int, dtype: jnp.dtype
) -> jax.Array:
    """Gather pages of every kv head straight into the [kv, pages * page_tokens, d] layout the
    matmuls want, in the model's `dtype`. flat_pool: the pool viewed as [layers * kv * pool_pages,
    page_tokens, d] (a free reshape, so no layer slice is ever copied; a 16-bit float model's as
    uint16 bits, POOL_AS_BITS); index: (layer * kv + head) * pool_pages per head."""
    rows = index[:, None] + pages[None, :]  # [kv, chunk_pages]
    chunk = from_pool(jnp.take(flat_pool, rows, axis=0), dtype)
    return chunk.reshape(kv_heads, pages.shape[0] * page_tokens, -1)


def key_step_pages(page_tokens: int, table_pages: int) -> int:
    """The pages of one masked key step (K_TAIL keys, within a whole K_CHUNK chunk of the table):
    the unit of a prefix's finer steps, and of the steps a SharedSteps group takes together."""
    chunk_pages = max(1, min(K_CHUNK // page_tokens, table_pages))
    return max(1, min(K_TAIL // page_tokens, chunk_pages))


def paged_prefix_rows(
    qr: jax.Array,
    n: int,
    pool_k: jax.Array,
    pool_v: jax.Array,
    meta: PagedAttentionMeta,
    group: int,
    causal_split: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Prefix part on rows. qr: [kv, rows, d] with rows >= (n + Q_BLOCK) * group (room for a block
    starting at any token). Per contiguous run of a segment: query blocks of Q_BLOCK tokens from the
    run's first token, then one block for the run's rest, the smallest of Q_TAILS that holds it;
    each block an online softmax over its segment's pages gathered from the pool: K_CHUNK keys a
    step, then K_TAIL-key steps, and one last step of K_TAIL or K_TAIL / 2 keys (a 300-token
    prefix computes 384 keys, not 1,024); the chunk steps below the keys every row of the block
    sees are unmasked, the K_TAIL steps masked. In a model with a sliding layer, every block
    takes the same kinds of steps from the page of the first key any row needs instead, all
    masked (kernels/paged.py: first_keys). Rows outside the run are left as they were.

    causal_split: runs that start before it are prefill chunks (kernels/paged.py) whose own
    K/V the call has already written into their pages after the prefix: each token of such a
    run sees its segment's keys up to its own position, so the result is the chunk's whole
    attention (prefix and causal part at once, in a few large steps instead of the causal
    part's many small blocks).

    Shared steps (meta.shared, a model without a sliding layer): a group of short chunks whose
    first keys lie in the same pages (sibling choices over one k-shot header) first takes those
    steps in one SHARED_BLOCK-token block from the group's first token, as more trips of the runs'
    loop; each chunk's own blocks then go on from the running softmax that block left in its rows.
    A row's steps are the same keys in the same order either way, so its bits do not change (where
    a row sits in its block moves none: SAME_BITS_ANYWHERE, held by kernels/selfcheck.py).

    Every block keeps its rows' running softmax (max, output and row sum) in the loop's state,
    finished once for every row at the end: a block starts from its rows' state, which is an empty
    softmax's unless a shared block came first.

    Returns out [kv, rows, d], lse [kv, rows] float32 (rows of segments without a prefix, outside
    the causal runs: 0 and MASK_VALUE)."""
    kv_heads, rows, d = qr.shape
    _, _, pool_pages, page_tokens, _ = pool_k.shape
    table = meta.page_table
    chunk_pages = max(1, min(K_CHUNK // page_tokens, table.shape[1]))
    tail_pages = key_step_pages(page_tokens, table.shape[1])
    last_pages = (max(1, tail_pages // 2), tail_pages)  # the last step: half or whole a tail step
    chunk_keys, tail_keys = chunk_pages * page_tokens, tail_pages * page_tokens
    # whole chunks of page ids, and one more: a windowed block's steps start at any page
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % chunk_pages + chunk_pages)))
    flat_k = pool_k.reshape(-1, page_tokens, d)
    flat_v = pool_v.reshape(-1, page_tokens, d)
    head_index = (meta.layer * kv_heads + jnp.arange(kv_heads, dtype=jnp.int32)) * pool_pages
    starts, ends, count = segment_runs(meta.segment_ids, n, causal_split)
    # Only the query blocks a run can need are compiled (each holds every key step of its size):
    # a run stays within its region, so none is longer than the longer region; its rest after
    # whole Q_BLOCKs, under Q_BLOCK tokens. Small buckets skip the big blocks (with the shared tail
    # loop, 128-token buckets' trace and compile took about 28% less, measured); a bucket of
    # Q_BLOCK tokens or more compiles them all, the Q_BLOCK one once (its loop takes a rest too).
    longest = max(causal_split, n - causal_split)
    rest_bound = min(longest, Q_BLOCK - 1)
    tails = Q_TAILS[: next(i for i, size in enumerate(Q_TAILS) if size >= rest_bound) + 1]
    smaller = tuple(size for size in tails if size < Q_BLOCK)  # the rests' own blocks
    first_key = first_keys(meta)  # [n]
    windowed = not never_windowed(meta.window)
    # shared steps: prefill chunks of a model without a sliding layer (a windowed block's steps
    # start at its rows' first keys, which no group shares)
    shared = meta.shared if causal_split > 0 and not windowed else None
    n_shared = 0 if shared is None else shared.count

    def step(qblk, pages, at: jax.Array, n_pages: int, carry, limit: jax.Array | None, low: jax.Array | None = None):
        """Keys at..at + n_pages * page_tokens of `pages`; limit [r] (None: no mask): the keys each
        row sees are below it, and (low [r], a window's) from low on."""
        ids = jax.lax.dynamic_slice_in_dim(pages, at // page_tokens, n_pages)
        kc = _segment_chunk(flat_k, head_index, ids, kv_heads, page_tokens, qr.dtype)
        vc = _with_ones(_segment_chunk(flat_v, head_index, ids, kv_heads, page_tokens, qr.dtype))
        raw = jnp.einsum("kqd,kcd->kqc", qblk, kc, preferred_element_type=jnp.float32)
        sc, scale = _logits(raw, meta.logits, d)
        if limit is not None:
            key = at + jnp.arange(n_pages * page_tokens)
            visible = key < limit[:, None]
            if low is not None:
                visible &= key >= low[:, None]
            # MASK_VALUE once scaled: a row a window shows no key ends with an LSE the merge weighs 0
            sc = jnp.where(visible, sc, MASK_VALUE / scale)
        return _online_step(carry, sc, vc, scale, "kqc,kcd->kqd")

    def unit(u: jax.Array, state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """The shared blocks first (units below n_shared), then the runs."""
        i = jnp.maximum(u - n_shared, 0)
        start, end = starts[i], ends[i]
        in_group = False
        if shared is not None:
            in_group = u < n_shared
            first_of_group = shared.blocks[jnp.minimum(u, shared.blocks.shape[0] - 1)]
            start = jnp.where(in_group, first_of_group, start)
            end = jnp.where(in_group, causal_split, end)  # its rows: block_of says which (mine)
        seg = meta.segment_ids[start]  # a group's: its first chunk's, whose pages it reads
        length = meta.prefix_len[seg]
        pages = table[seg]
        causal = start < causal_split  # a prefill chunk: its own keys follow the prefix
        # the key steps a group takes (its block's), and those a chunk of one took there
        taken = 0
        if shared is not None:
            taken = jnp.where(causal, shared.steps[jnp.minimum(start, causal_split - 1)], 0)

        def key_steps(qblk, limit: jax.Array, low: jax.Array | None, carry):
            """A block's key steps: each row's keys fall into the same steps whatever else its block
            holds, so how a query was cut into chunks or which tokens share a block never changes a
            row's bits (a step a row sees nothing of leaves it exactly as it was).
            - item rows of a model without a sliding layer see their segment's whole prefix: the
              steps follow its length alone: whole K_CHUNK chunks unmasked, then K_TAIL-key steps,
              masked, and a rest of at most half a step in one step of half (a 300-token prefix
              computes 384 keys, not 1,024). A tail step every row sees whole is masked too: the same
              arithmetic for a compare and a select per score, and fewer step bodies to compile;
            - rows whose keys end at their own position (a prefill chunk's) or start at their
              window's first key: K_TAIL-key steps at multiples of K_TAIL, from the step of min(low)
              (0 without a window) to max(limit), every step masked; a shared block's first `taken`
              of them, and its chunks' own blocks the rest (shared steps, above).
            One loop body of each kind of step, whichever rows a block holds."""
            if low is None:
                full = jnp.where(causal, 0, length // chunk_keys)
                keys = length - full * chunk_keys
                whole, base = keys // tail_keys, full * chunk_keys
                rest = keys - whole * tail_keys
                half = (rest > 0) & (rest <= last_pages[0] * page_tokens) & ~causal
                by_position = (jnp.max(limit) + tail_keys - 1) // tail_keys
                count = jnp.where(causal, by_position, whole + ((rest > 0) & ~half))
            else:
                full, half = 0, False
                base = jnp.min(low) // tail_keys * tail_keys
                count = (jnp.maximum(jnp.max(limit) - base, 0) + tail_keys - 1) // tail_keys
            first = 0
            if shared is not None:
                first = jnp.where(in_group, 0, taken)
                count = jnp.where(in_group, taken, count)
            carry = jax.lax.fori_loop(
                0, full, lambda c, cr: step(qblk, pages, c * chunk_keys, chunk_pages, cr, None), carry
            )
            carry = jax.lax.fori_loop(
                first, count, lambda c, cr: step(qblk, pages, base + c * tail_keys, tail_pages, cr, limit, low), carry
            )
            if low is not None:
                return carry
            return jax.lax.cond(
                half,
                lambda cr: step(qblk, pages, base + count * tail_keys, last_pages[0], cr, limit),
                lambda cr: cr,
                carry,
            )

        def block(first_token: jax.Array, size: int, state: tuple[jax.Array, jax.Array]):
            r = size * group
            at = first_token * group
            qblk = jax.lax.dynamic_slice_in_dim(qr, at, r, axis=1)
            token = first_token + jnp.repeat(jnp.arange(size, dtype=jnp.int32), group)  # row -> its token
            row_token = jnp.minimum(token, end - 1)  # rows past the run: its last token's
            # keys each row sees: the prefix; a chunk's row also its chunk's up to its own position
            # (the key at its position: kernels/paged.py)
            limit = jnp.where(causal, jnp.take(meta.positions, row_token) + 1, length)
            low = jnp.take(first_key, row_token)  # [r]: and from the row's window on
            old_acc = jax.lax.dynamic_slice_in_dim(state[0], at, r, axis=1)
            old_m = jax.lax.dynamic_slice_in_dim(state[1], at, r, axis=1)
            # A model with a sliding layer takes the windowed steps on every layer, its full layers
            # too (their rows' low is 0: the same keys, every step masked): one set of step bodies
            # per query block instead of two under a branch; a model with none, no window's bounds
            m, acc = key_steps(qblk, limit, low if windowed else None, (old_m, old_acc))
            mine = token < end  # [r]: rows of this run (the last block may overhang it)
            if shared is not None:  # a group's block: its chunks' rows
                in_it = jnp.take(shared.block_of, jnp.minimum(token, causal_split - 1)) == start
                mine = jnp.where(in_group, in_it & (token < causal_split), mine)
            return (
                jax.lax.dynamic_update_slice_in_dim(state[0], jnp.where(mine[:, None], acc, old_acc), at, axis=1),
                jax.lax.dynamic_update_slice_in_dim(state[1], jnp.where(mine, m, old_m), at, axis=1),
            )

        # a prefill-region run of padding alone (segment 0, past the last chunk, or a replica with
        # no chunk): nothing reads it, so it takes no block (its rows stay as they were)
        live = meta.item_ids[start] >= 0
        tokens = jnp.where((causal & live) | (length > 0), end - start, 0)
        if shared is not None:
            tokens = jnp.where(in_group, SHARED_BLOCK, tokens)
        if tails[-1] == Q_BLOCK:
            # whole Q_BLOCKs, and a rest longer than every smaller tail as one more trip of the same
            # loop: one copy of the Q_BLOCK block's steps in the program, not two (a loop's and a
            # branch's), the same blocks in the same order
            whole = tokens // Q_BLOCK
            rem = tokens - whole * Q_BLOCK
            longer = rem > smaller[-1]  # Q_TAILS starts below Q_BLOCK: `smaller` is never empty
            trips = whole + longer.astype(jnp.int32)
            state = jax.lax.fori_loop(0, trips, lambda b, o: block(start + b * Q_BLOCK, Q_BLOCK, o), state)
            rem, rest_at = jnp.where(longer, 0, rem), start + whole * Q_BLOCK
        else:
            rem, rest_at = tokens, start
        # 0: no rest (or taken by the loop); k: the k-th of `smaller` is the smallest that holds it
        kind = jnp.where(rem == 0, 0, 1 + sum((rem > size).astype(jnp.int32) for size in smaller[:-1]))
        return jax.lax.switch(
            kind, [lambda o: o] + [lambda o, size=size: block(rest_at, size, o) for size in smaller], state
        )

    # every row's running softmax: output and row sum [kv, rows, d + 1], max [kv, rows]
    init = (jnp.zeros((kv_heads, rows, d + 1), jnp.float32), jnp.full((kv_heads, rows), MASK_VALUE, jnp.float32))
    acc, m = jax.lax.fori_loop(0, n_shared + count, unit, init)
    return _finish(m, acc, jnp.float32)


def _prefix_part(
    q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta, causal_split: int
) -> tuple[jax.Array, jax.Array]:
    n, heads, _ = q.shape
    kv_heads = pool_k.shape[1]
    # padded after the transpose, as _ragged_inputs's
    qr = jnp.pad(to_rows(q, kv_heads), ((0, 0), (0, Q_BLOCK * (heads // kv_heads)), (0, 0)))
    out, lse = paged_prefix_rows(qr, n, pool_k, pool_v, meta, heads // kv_heads, causal_split)
    return from_rows(out, heads)[:n].astype(q.dtype), lse_from_rows(lse, heads)[:n]


def paged_prefix_attention(
    q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> tuple[jax.Array, jax.Array]:
    """Every token against its segment's prefix pages (kernels/paged.py), tiled for CPUs: see
    paged_prefix_rows. q: [T, heads, d]; pool_k, pool_v: [layers, kv, pages, page_tokens, d].
    Returns out [T, heads, d] (q.dtype) and lse [T, heads] float32."""
    return _prefix_part(q, pool_k, pool_v, meta, causal_split=0)


def paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pool_k: jax.Array, pool_v: jax.Array, meta: PagedAttentionMeta
) -> jax.Array:
    """A call's whole stream. q: [T, heads, d]; k, v: [T, kv, d]. Returns [T, heads, d].

    The prefill region's chunks read their own K/V back from the pool, where the call wrote it
    before attention (kernels/paged.py): their whole attention is the prefix part extended to
    each token's own position (paged_prefix_rows' causal runs), with no causal part or merge.
    The item region: prefix part from the pool, causal part per item, merged in float32. A call
    of whole sequences (no prefill region, no segment with a prefix: embeddings, classification)
    takes the causal part alone: merged with a prefix part that saw no key, each row is its causal
    part's exactly (weight exp(MASK_VALUE - lse) = 0 against 1), so skipping both moves no bit."""
    s = meta.split

    def prefix_part() -> tuple[jax.Array, jax.Array]:
        with jax.named_scope("prefix_part"):  # scopes: the parts `bench --profile` reports
            return _prefix_part(q, pool_k, pool_v, meta, causal_split=s)

    if s == q.shape[0]:
        return prefix_part()[0]
    with jax.named_scope("item_part"):
        out_i, lse_i = ragged_item_attention(
            q[s:], k[s:], v[s:], meta.item_ids[s:], meta.max_item_len, meta.window, meta.logits
        )

    def merged() -> jax.Array:
        out_p, lse_p = prefix_part()
        with jax.named_scope("merge"):
            items = merge_attention(out_p[s:], lse_p[s:], out_i, lse_i)
        return items if s == 0 else jnp.concatenate([out_p[:s], items])

    if s > 0:
        return merged()
    return jax.lax.cond(jnp.any(meta.prefix_len > 0), merged, lambda: out_i)
