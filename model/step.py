"""The one device call (per device): prefill chunks of new queries and items of many queries,
over the paged prefix pool. engine/runtime/scoring_engine.py wraps it in `shard_map` and `jit`, one executable
per CallShape (engine/runtime/planner.py lays out its inputs).

Per layer: the projections of every token of the stream; the prefill region's K/V written
into the pool pages (in place: the pool is a loop carry, donated to the call), and the slots
the call copies between pages (a query's leading tokens another query holds); then the
attention of every token over its segment's pages and its own item (kernels/paged.py),
so chunks and items placed after their query's chunks in the same call see them. Only
the rows' tokens reach the output head (and on a CPU run the last layer past its attention):
an item's last token (the vocabulary's, with per-row label sets and softmax, or a classifier's score
rows), or in a call with token rows every token of a likelihood item (its next token's
log-prob and the vocabulary's top log-probs). It returns [R, L] per row, and TOKEN_COLUMNS more
in a call with token rows.
Every length that varies between calls is a runtime value, never a shape.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import jax
import jax.numpy as jnp

from prefixscore.kernels.paged import NO_WINDOW, AttentionLogits, PagedAttentionMeta, SharedSteps, to_pool
from prefixscore.model.call_inputs import (
    OUTPUT_FULL,
    OUTPUT_LOGIT,
    OUTPUT_SOFTMAX,
    TOP_LOGPROBS,
    CallInputs,
    PageCopies,
)
from prefixscore.model.config import ModelConfig
from prefixscore.model.decoder import ReadRows, embed, norm, run_layers, softcap
from prefixscore.model.head import output_head
from prefixscore.model.row_steps import in_steps
from prefixscore.model.shards import ALONE, UNSPLIT, DataReplicas, ModelShards
from prefixscore.model.weights import Weights

# vocabulary rows per step of the full-vocabulary log-sum-exp: a [rows, VOCAB_CHUNK]
# float32 logits tile stays in cache instead of a [rows, vocab] matrix in memory
VOCAB_CHUNK = 2048
# the rows of one step of the output head (see head_rows_loop)
MIN_HEAD_ROWS = 32


def score_call(
    params: Weights,
    cfg: ModelConfig,
    pool_k: jax.Array,
    pool_v: jax.Array,
    call: CallInputs,
    *,
    impl: ModuleType,
    head_rows: int,
    static_head: bool = False,
    token_tile: int | None = None,
    shards: ModelShards = UNSPLIT,
    replicas: DataReplicas = ALONE,
    top_logprobs: int = 0,
    hidden: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's share of a call. pool_k, pool_v: [layers, kv, pages, page_tokens, hd];
    call: this device's CallInputs (prefill and item region arrays with a leading axis of 1).
    static_head: the output head over every row slot, with no loop or branch on runtime
    values. On GPUs such a loop or branch reads its predicate back to the host, so the
    launch would return only when the device reached the head: the host could not plan the
    next call meanwhile. The rows computed in vain cost far less there than that wait.
    token_tile: the tokens per step of each layer's per-token work (decoder.per_tile; None: all at once).
    shards: the model axis (model/shards.py): this device's heads, MLP columns and vocabulary
    rows; the pool holds this device's KV heads.
    replicas: the data axis: this device's prefill region holds its replica's chunks only; each
    layer's pool write takes every replica's (all-gathered), so every pool gets every page.
    top_logprobs: the call's CallShape.top_logprobs (static): TOP_LOGPROBS adds each row's
    token columns (row_token_logprobs; meaningful for OUTPUT_TOKEN rows only).
    hidden: the call's CallShape.hidden > 0 (static): adds each row's final-normed hidden state
    [hidden size] after them (meaningful for OUTPUT_HIDDEN rows only).
    Returns label probabilities [R, L] float32 (column j: the row's j-th label; rows past
    n_rows and columns past a row's labels are 0), then the token and hidden columns if asked,
    and the pool with the chunks written."""
    prefill = jax.tree.map(lambda a: a[0], call.prefill)
    items = jax.tree.map(lambda a: a[0], call.items)
    split = prefill.tokens.shape[0]
    tokens = jnp.concatenate([prefill.tokens, items.tokens])  # [Tp + Ti]
    positions = jnp.concatenate([prefill.positions, items.positions])
    # [layers] int32: the layer scan's index picks its layer's window (_at_layer); a model with no
    # sliding layer traces the static NO_WINDOW instead, so no kernel compiles a windowed branch
    windowed = any(w is not None for w in cfg.layer_windows)
    layer_windows = jnp.asarray([NO_WINDOW if w is None else w for w in cfg.layer_windows], jnp.int32)
    meta = PagedAttentionMeta(
        segment_ids=jnp.concatenate([prefill.segment_ids, items.segment_ids]),
        item_ids=jnp.concatenate([prefill.item_ids, items.item_ids]),
        page_table=call.page_table,
        prefix_len=call.prefix_len,
        max_chunk_len=call.max_chunk_len,
        max_item_len=items.max_item_len,
        layer=jnp.int32(0),
        positions=positions,
        window=layer_windows[0] if windowed else NO_WINDOW,
        shared=SharedSteps(prefill.shared_blocks, prefill.shared_count, prefill.shared_block_of, prefill.shared_steps),
        split=split,
        logits=AttentionLogits(scale=cfg.attn_scale, softcap=cfg.attn_softcap),
    )

    if split:  # where every replica's prefill tokens go: the same for every layer
        with jax.named_scope("pool_write"):
            write_pages, write_offsets = replicas.gather(prefill.write_pages), replicas.gather(prefill.write_offsets)

    def attend(q, k, v, layer, pool):
        pk, pv = pool
        if split:  # every replica's prefill K/V into its pages first: later tokens read them
            with jax.named_scope("pool_write"):
                at = (layer, slice(None), write_pages, write_offsets)
                # padding's page: out of range; the pool may hold the K/V's bits (paged.pool_dtype)
                pk = pk.at[at].set(to_pool(replicas.gather(k[0, :split]), pk.dtype), mode="drop")
                pv = pv.at[at].set(to_pool(replicas.gather(v[0, :split]), pv.dtype), mode="drop")
            with jax.named_scope("pool_copy"):  # leading tokens another query holds, after its writes
                pk, pv = (_copy_slots(pool, layer, call.copies) for pool in (pk, pv))
        at = _at_layer(meta, layer, layer_windows) if windowed else dataclasses.replace(meta, layer=layer)
        out = impl.paged_attention(q[0], k[0], v[0], pk, pv, at)
        return out[None], (pk, pv)

    with jax.named_scope("embed"):
        x = embed(params, cfg, tokens[None], shards)
    # a token is read when it is a chunk's or an item's (padding has negative ids): tiles of padding
    # alone skip their per-token work
    live = (meta.item_ids >= 0)[None]
    # where the layers' work is tiled (a CPU), the last layer past its attention runs at the rows
    # the head reads only (moved to the stream's front), when the stream can hold them
    rows_read_alone = token_tile is not None and items.read_at.shape[0] <= tokens.shape[0]
    read = ReadRows(items.read_at, items.n_rows) if rows_read_alone else None
    h, (pool_k, pool_v) = run_layers(
        params, cfg, x, positions, attend, (pool_k, pool_v), token_tile, shards, live, read
    )
    with jax.named_scope("head"):
        at_rows = h[0, : items.read_at.shape[0]] if read is not None else jnp.take(h[0], items.read_at, axis=0)
        rows = (at_rows, items.label_set, items.output)
        if top_logprobs:
            rows += (items.target,)

        def head(h_last, sets, output, target=None, always_lse=False):
            row_labels = jnp.take(call.label_sets, sets, axis=0)
            columns = [row_label_probs(params, cfg, h_last, call.labels, row_labels, output, always_lse, shards)]
            if target is not None:
                columns.append(row_token_logprobs(params, cfg, h_last, target, shards))
            if hidden:  # what a sentence-transformers Transformer module returns: after the final norm
                columns.append(norm(cfg, h_last, params.final_norm).astype(jnp.float32))
            return jnp.concatenate(columns, axis=1) if len(columns) > 1 else columns[0]

        if static_head:
            probs = head(*rows, always_lse=True)
        else:
            probs = head_rows_loop(head, rows, items.n_rows, head_rows)
    return probs, pool_k, pool_v


def _copy_slots(pool: jax.Array, layer: jax.Array, copies: PageCopies) -> jax.Array:
    """One layer of `pool` with the copies' slots set from theirs (padding: dropped)."""
    slots = pool[layer, :, copies.from_pages, copies.from_offsets]
    return pool.at[layer, :, copies.to_pages, copies.to_offsets].set(slots, mode="drop")


def _at_layer(meta: PagedAttentionMeta, layer: jax.Array, layer_windows: jax.Array) -> PagedAttentionMeta:
    """The meta of one layer (a traced index): its pages and its window (layer_windows [layers])."""
    return dataclasses.replace(meta, layer=layer, window=layer_windows[layer])


def vocab_logsumexp(
    h: jax.Array, w: jax.Array, real_rows: jax.Array | None = None, cap: float | None = None
) -> jax.Array:
    """log(sum(exp(softcap(h @ w.T)))) per row without materialising the logits.

    h: [rows, hidden] (normalised); w: [vocab, hidden]; real_rows: only w's first real_rows
    rows count (a vocabulary shard ending in padding); None: all; cap: the logits' soft cap
    (decoder.softcap; None: none). Returns [rows] float32.
    """
    return vocab_scan(h, w, real_rows, cap)[0]


def vocab_scan(
    h: jax.Array,
    w: jax.Array,
    real_rows: jax.Array | None = None,
    cap: float | None = None,
    top: int = 0,
    first_id: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-sum-exp of softcap(h @ w.T) per row, and its `top` largest logits with their ids,
    without materialising the logits: an online max/sum (and a running top-k, merged with each
    slice's own) over VOCAB_CHUNK-row slices of w, plus one static remainder.

    h, w, real_rows, cap: as vocab_logsumexp; first_id: the vocabulary id of w's first row (a
    shard's). Returns (lse [rows], top logits [rows, top] descending, their ids [rows, top]
    int32); ties keep the lower id first, as an argmax does.
    """
    vocab = w.shape[0]
    chunk = min(VOCAB_CHUNK, vocab)
    full = vocab // chunk
    rows = h.shape[0]
    Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def update(carry: Carry, wc: jax.Array, first: jax.Array) -> Carry:
        m, total, top_vals, top_ids = carry
        s = softcap(jnp.einsum("rh,vh->rv", h, wc, preferred_element_type=jnp.float32), cap)
        if real_rows is not None:
            s = jnp.where(first + jnp.arange(wc.shape[0]) < real_rows, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        total = total * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]), axis=-1)
        if top:
            vals, at = jax.lax.top_k(s, min(top, wc.shape[0]))
            # the running top first: a tie keeps the lower id
            merged_vals = jnp.concatenate([top_vals, vals], axis=1)
            merged_ids = jnp.concatenate([top_ids, at.astype(jnp.int32) + first + first_id], axis=1)
            top_vals, pick = jax.lax.top_k(merged_vals, top)
            top_ids = jnp.take_along_axis(merged_ids, pick, axis=1)
        return m_new, total, top_vals, top_ids

    def step(i: jax.Array, carry: Carry) -> Carry:
        return update(carry, jax.lax.dynamic_slice_in_dim(w, i * chunk, chunk), i * chunk)

    carry = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.full((rows, top), -jnp.inf, jnp.float32),
        jnp.zeros((rows, top), jnp.int32),
    )
    carry = jax.lax.fori_loop(0, full, step, carry)
    if vocab > full * chunk:
        carry = update(carry, w[full * chunk :], jnp.int32(full * chunk))
    m, total, top_vals, top_ids = carry
    return m + jnp.log(total), top_vals, top_ids


def row_token_logprobs(
    params: Weights, cfg: ModelConfig, h_at: jax.Array, target: jax.Array, shards: ModelShards = UNSPLIT
) -> jax.Array:
    """Each token row's next-token log-probabilities over the whole vocabulary (a causal LM).

    h_at: [rows, hidden] the hidden state at the row's token; target: [rows] int32, the token
    whose log-prob the row returns (the item's next token). The logits are soft-capped as the
    label path's; with the vocabulary split on the model axis, each device scans its shard and
    the log-sum-exp and the top log-probs are combined across devices.
    Returns [rows, TOKEN_COLUMNS] float32: the target's log-prob, the TOP_LOGPROBS largest
    log-probs (descending), their ids (as float32).
    """
    h = norm(cfg, h_at, params.final_norm)
    w = params.projection(output_head(cfg))
    target_logit = jnp.einsum("rh,rh->r", h, shards.take_rows(w, target), preferred_element_type=jnp.float32)
    target_logit = softcap(target_logit, cfg.final_softcap)
    local = w.shape[0]
    lse, top_vals, top_ids = vocab_scan(
        h, w, shards.real_rows(local), cfg.final_softcap, TOP_LOGPROBS, shards.first_row(local)
    )
    lse = shards.logsumexp(lse)
    top_vals, top_ids = shards.top(top_vals, top_ids)
    return jnp.concatenate(
        [(target_logit - lse)[:, None], top_vals - lse[:, None], top_ids.astype(jnp.float32)], axis=1
    )


def row_label_probs(
    params: Weights,
    cfg: ModelConfig,
    h_last: jax.Array,
    labels: jax.Array,
    row_labels: jax.Array,
    output: jax.Array,
    always_lse: bool = False,
    shards: ModelShards = UNSPLIT,
) -> jax.Array:
    """Each row's label probabilities from its last hidden state.

    h_last: [rows, hidden]; labels: [L] the call's label ids; row_labels: [rows, L] indices
    into labels (-1: unused); output: [rows] int8, what each row returns (call_inputs.OUTPUT_*).
    The call's label logits are one [rows, L] product; a row's are gathered from it. OUTPUT_SOFTMAX
    rows get the softmax over their labels, OUTPUT_LOGIT rows the (soft-capped) logits as they are,
    OUTPUT_FULL rows the full-vocabulary probability exp(logit - logsumexp over the vocabulary),
    computed in cache-sized tiles, and only when some row of the step needs it (always with
    `always_lse`: no branch on a runtime value). With the vocabulary split across the model
    axis (shards), the label rows are looked up in their shards and each device reduces its
    own rows' log-sum-exp, combined across devices: the logits never leave a device.
    A head that scores its own rows (a classifier's, model/head.py) has no vocabulary: `labels`
    index its score rows (held whole on every device), and each row gets its raw logits; the
    activation the request asked for is applied on the host (engine/requests/heads.py).
    Returns [rows, L] float32 (unused columns 0).
    """
    head = output_head(cfg)
    if not head.rows:  # a base model: no head, and no request names a label (engine/requests/heads.py)
        return jnp.zeros((h_last.shape[0], labels.shape[0]), jnp.float32)
    h = norm(cfg, h_last, params.final_norm)
    valid = row_labels >= 0
    w = params.projection(head)
    if head.own_rows:
        logits = jnp.einsum("bh,lh->bl", h, jnp.take(w, labels, axis=0), preferred_element_type=jnp.float32)
        return jnp.where(valid, jnp.take_along_axis(logits, jnp.maximum(row_labels, 0), axis=1), 0.0)
    logits = jnp.einsum("bh,lh->bl", h, shards.take_rows(w, labels), preferred_element_type=jnp.float32)
    logits = softcap(logits, cfg.final_softcap)
    logits = jnp.take_along_axis(logits, jnp.maximum(row_labels, 0), axis=1)  # [rows, L]
    soft = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)

    def lse_all() -> jax.Array:
        return shards.logsumexp(vocab_logsumexp(h, w, shards.real_rows(w.shape[0]), cfg.final_softcap))

    if always_lse:
        lse = lse_all()
    else:
        lse = jax.lax.cond(
            jnp.any(output == OUTPUT_FULL),
            lse_all,
            lambda: jnp.zeros(h.shape[0], jnp.float32),
        )
    full = jnp.exp(logits - lse[:, None])
    rows = output[:, None]
    return jnp.where(valid, jnp.where(rows == OUTPUT_SOFTMAX, soft, jnp.where(rows == OUTPUT_LOGIT, logits, full)), 0.0)


def head_rows_loop(fn, rows: tuple[jax.Array, ...], n_rows: jax.Array, step_rows: int = MIN_HEAD_ROWS) -> jax.Array:
    """Run the output head only on the rows that hold an item, `step_rows` rows a step.

    fn(*row_slices) -> [step_rows, out]; rows: arrays with a leading row axis [R, ...]. Every step
    has the same rows in every call (rows are padded to a whole step when a call has fewer): the
    head's norm, products and vocabulary reductions are compiled for that shape once, so a row's
    bits never depend on how many rows its call holds (XLA:CPU lays a reduction out by its
    operand's shape: the final norm of 13 rows differed in its last bits as one of 32 rows or of
    256). Each step streams the whole output matrix, and a matmul of few rows runs below the CPU's
    rate: steps of 32 rows cost more than steps of 64 where a call holds many rows
    (engine/runtime/buckets.py). Returns [R, out] float32; rows past n_rows are zero or garbage.
    """
    return in_steps(fn, step_rows, rows, (n_rows + step_rows - 1) // step_rows)
