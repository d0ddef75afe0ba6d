"""What every attention implementation is handed for one device call: a token stream whose
tokens read their prefix from pages of the KV pool, plus their own causal items.

The stream of one device call holds tokens of many queries. Tokens are grouped into
contiguous **segments**; a segment reads the first `prefix_len` tokens of its own
pages (one page-table row) as its prefix, with no mask inside it. Within a segment,
tokens form contiguous causal **items** (an item sees itself causally, nothing of
another item). Three kinds of segment share one call:

- items of a cached query: prefix_len = the query's length;
- a prefill chunk of a query: prefix_len = where the chunk starts (its earlier
  chunks, written into the same pages earlier in this call or in an earlier one),
  the chunk itself one causal item;
- whole sequences (item_first, the sequential baseline): prefix_len = 0.

Padding tokens (bucket rounding, alignment gaps) carry negative item ids, one per token;
no real token sees them and their outputs are never read, so an implementation may leave
any finite value there.

The stream has two regions: the first `split` tokens hold prefill chunks (their
K/V is written into the pool before any token reads it, layer by layer), the rest
items. They differ only in how long their items are, so the causal part runs per
region: short items never pay for the long chunks' blocks.

Windows and logits. A token's position (`positions`, its RoPE position in `query + item`)
is the index of its own key within its segment's pages: prefix key c sits at position c,
and positions are contiguous within an item. On a layer with a sliding window `w`
(`window`, traced: set per layer inside the layer scan) a token at position p sees only
keys at positions in (p - w, p] (transformers' `sliding_window`): prefix keys c >= p - w + 1,
and the earlier tokens of its own item at most w - 1 stream indices back. A token may so see
no prefix key at all: its prefix part is then empty (an LSE of about MASK_VALUE, which the
merge weighs 0), like a segment without a prefix. NO_WINDOW (a value past any position) is a layer without a window.
Implementations mask the keys a window hides inside their tiles, and skip the pages and key
blocks that no token of a query block (or run) can see. `logits` (static, per model) is
how raw q.k scores become logits: times `scale` (head_dim ** -0.5 by default), then, with a
`softcap`, cap * tanh(s / cap) (Gemma 2), before masking and softmax.

Pool layout: [layers, kv_heads, pages, page_tokens, head_dim]. One kv head's page is
a contiguous [page_tokens, head_dim] tile, which is what a kernel fetches per step
(a TPU DMA, a GPU block load) and what the CPU path gathers without a transpose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

# a layer's window that hides nothing: past any position (and 2 * NO_WINDOW fits int32)
NO_WINDOW = 2**30


def pool_dtype(dtype: jnp.dtype, as_bits: bool) -> jnp.dtype:
    """What the pool stores a model's K/V in: `dtype`, or with `as_bits` (an implementation's
    POOL_AS_BITS) a 16-bit float's bits as uint16. XLA:CPU scatters into and gathers from a
    16-bit float array by converting the whole operand to float32 and back: per layer, the
    whole pool twice over for each of K and V (a bfloat16 SmolLM2 ran 5x slower than float32).
    On integers both are plain copies; the same bytes, so pages and budgets are unchanged."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if as_bits and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 else dtype


def to_pool(x: jax.Array, stored: jnp.dtype) -> jax.Array:
    """K/V in the model's dtype -> what a pool of dtype `stored` holds (pool_dtype)."""
    return jax.lax.bitcast_convert_type(x, stored) if stored == jnp.uint16 else x


def from_pool(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Values read from the pool (pages gathered, never the whole pool) -> the model's `dtype`."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x


@dataclasses.dataclass(frozen=True)
class AttentionLogits:
    """How raw scores q.k become attention logits (static per model, hashable): times `scale`
    (None: head_dim ** -0.5), then `softcap * tanh(s / softcap)` with a softcap (None: none)."""

    scale: float | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        # a positive scale keeps the max of raw scores the max of the logits (xla's online softmax)
        for name in ("scale", "softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"AttentionLogits.{name} must be positive, got {value}")

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale

    def cap(self, s: jax.Array) -> jax.Array:
        """Scaled scores -> logits (the soft cap, if any)."""
        return s if self.softcap is None else self.softcap * jnp.tanh(s / self.softcap)

    def apply(self, raw: jax.Array, head_dim: int) -> jax.Array:
        """Raw scores q.k (float32) -> logits, to be masked and soft-maxed."""
        return self.cap(raw * self.scale_for(head_dim))


DEFAULT_LOGITS = AttentionLogits()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedSteps:
    """Short prefill chunks whose first keys lie in the same pages, grouped by the planner
    (engine/runtime/shared_steps.py) for an implementation that takes those key steps once for
    the group (its SHARED_BLOCK: kernels/xla.py). A group's chunks sit within SHARED_BLOCK tokens of
    its first chunk's first token, where its block starts; the block reads that chunk's pages for
    `steps` key steps (the implementation's key step, in pages: key_step_pages), which every chunk
    of the group reads alike. Arrays over the prefill region [Tp] int32."""

    blocks: jax.Array  # each group's first token, in stream order; -1 past the last
    count: jax.Array  # [] int32: the groups
    block_of: jax.Array  # per token: the first token of its chunk's group (-1: in none)
    steps: jax.Array  # per token: the key steps its group takes (0: in none)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionMeta:
    """Per-call attention metadata (a pytree: arrays are leaves, `split` and `logits` are static)."""

    segment_ids: jax.Array  # [T] int32: the segment (page-table row) each token reads its prefix from
    item_ids: jax.Array  # [T] int32: equal (contiguous) ids form one causal item
    page_table: jax.Array  # [S, P] int32: the pool pages of each segment's prefix, in order
    prefix_len: jax.Array  # [S] int32: prefix tokens each segment sees (0: none)
    max_chunk_len: jax.Array  # [] int32: an upper bound on a prefill chunk's length (the prefill region)
    max_item_len: jax.Array  # [] int32: an upper bound on an item's length (the item region)
    layer: jax.Array  # [] int32: the layer whose pages are read
    positions: jax.Array  # [T] int32: each token's position (its key's index within its segment's pages)
    # [] int32: the layer's sliding window (keys at positions > p - window), NO_WINDOW on a layer
    # without one; the Python int NO_WINDOW when no layer of the model slides (never_windowed)
    window: jax.Array | int
    # the prefill region's shared key steps (SharedSteps); None: none planned
    shared: SharedSteps | None = None
    split: int = dataclasses.field(default=0, metadata=dict(static=True))  # tokens of the prefill region
    logits: AttentionLogits = dataclasses.field(default=DEFAULT_LOGITS, metadata=dict(static=True))


def first_visible(positions: jax.Array, window: jax.Array | int) -> jax.Array:
    """[n] int32 -> the first key position each token sees: keys in (p - window, p]."""
    return jnp.maximum(positions - window + 1, 0)


def never_windowed(window: jax.Array | int) -> bool:
    """Whether `window` is the static NO_WINDOW a model with no sliding layer traces with: the
    kernels then leave out their windowed branches (fewer branches compile faster)."""
    return isinstance(window, int) and window >= NO_WINDOW


def first_keys(meta: PagedAttentionMeta) -> jax.Array:
    """[T] int32: the first key each token of the stream needs from its segment's pages, for the
    kernels' masks and skipping. A padding token (never read) needs none (NO_WINDOW): alignment
    padding at position 0 must not make its block read a whole windowed prefix."""
    return jnp.where(meta.item_ids >= 0, first_visible(meta.positions, meta.window), NO_WINDOW)


def segment_runs(segment_ids: jax.Array, max_runs: int, split: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The contiguous runs of equal segment ids in a stream; a run never crosses `split`
    (the regions' boundary: the prefill region may end in the segment the item region starts with).

    segment_ids: [T]. Returns starts [max_runs], ends [max_runs] (exclusive) and the
    number of runs (int32 scalar); entries past it are T. max_runs >= the runs there are.
    """
    n = segment_ids.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones((1,), bool), segment_ids[1:] != segment_ids[:-1]]) | (idx == split)
    run = jnp.cumsum(is_start.astype(jnp.int32)) - 1
    starts = jnp.full((max_runs + 1,), n, jnp.int32).at[jnp.where(is_start, run, max_runs)].set(idx)[:max_runs]
    count = run[-1] + 1
    ends = jnp.concatenate([starts[1:], jnp.full((1,), n, jnp.int32)])  # unfilled starts are n too
    return starts, ends, count


def segment_starts(segment_ids: jax.Array, boundary: int = 0) -> jax.Array:
    """[n] -> the stream index where each token's (contiguous) segment starts. A segment also
    starts at `boundary` (the regions' split: the prefill region may end in the segment the
    item region starts with), whatever the ids on either side."""
    idx = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones((1,), bool), segment_ids[1:] != segment_ids[:-1]]) | (idx == boundary)
    return jax.lax.cummax(jnp.where(is_start, idx, 0))


def causal_by_region(
    ragged_item_attention: Callable[..., tuple[jax.Array, jax.Array]],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    meta: PagedAttentionMeta,
) -> tuple[jax.Array, jax.Array]:
    """The causal part (an implementation's `ragged_item_attention`) of each region on its own,
    concatenated: the items' short blocks never pay for the prefill chunks' long ones.
    q: [T, heads, d]; k, v: [T, kv, d]. Returns out [T, heads, d], lse [T, heads] float32."""
    s = meta.split

    def ragged(rows: slice, bound: jax.Array) -> tuple[jax.Array, jax.Array]:
        return ragged_item_attention(q[rows], k[rows], v[rows], meta.item_ids[rows], bound, meta.window, meta.logits)

    if s == 0:
        return ragged(slice(None), meta.max_item_len)
    if s == q.shape[0]:
        return ragged(slice(None), meta.max_chunk_len)
    a = ragged(slice(None, s), meta.max_chunk_len)
    b = ragged(slice(s, None), meta.max_item_len)
    return jnp.concatenate([a[0], b[0]]), jnp.concatenate([a[1], b[1]])
