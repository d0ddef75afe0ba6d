"""The decoder (Llama / Qwen2 / Qwen3 / Gemma families) as free functions over typed weights.

The weights (model/weights.py: `Weights`, `LayerWeights`, `AttentionWeights`,
`MlpWeights`, each field with its shape) stack every layer's tensors on a leading layer
axis, so the layers run under one `lax.scan`, which keeps compile time independent of
depth. Each layer's attention and MLP run under their own `jax.named_scope`.

Everything follows the Hugging Face modelling code numerically (RMSNorm in
float32, RoPE tables in float32), which is what makes 1e-4 parity possible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from prefixscore.model.config import ModelConfig
from prefixscore.model.head import output_head
from prefixscore.model.quant import matmul
from prefixscore.model.rope import rope_tables
from prefixscore.model.row_steps import in_steps
from prefixscore.model.shards import UNSPLIT, ModelShards
from prefixscore.model.weights import AttentionWeights, LayerWeights, MlpWeights, Weights

# attend(q [b,t,heads,hd], k [b,t,kv,hd], v [b,t,kv,hd], layer [] int32, state) -> ([b,t,heads,hd], state)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """HF RMSNorm: normalise in float32. x: [..., dim].

    Llama's casts back, then scales by the weight; Gemma's (plus_one) scales by 1 + weight in
    float32, then casts (they differ in the last bit of a bfloat16)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """The model's RMSNorm (its epsilon and weight convention)."""
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_plus_one)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
    """Rotate-half RoPE. x: [b, t, heads, hd]; positions: [b, t] or [t] int32; inv_freq [hd/2]
    float32; scale: cos and sin are multiplied by it in float32 (YaRN's attention factor)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., t, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = (jnp.cos(emb) * scale).astype(x.dtype)[..., None, :]
    sin = (jnp.sin(emb) * scale).astype(x.dtype)[..., None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@struct.dataclass
class LayerRope:
    """One layer's RoPE (a row of rope.rope_tables), carried through the layer scan."""

    inv_freq: jax.Array  # [hd / 2] float32
    scale: jax.Array  # [] float32: cos/sin multiplier


def _qkv(
    attn: AttentionWeights, cfg: ModelConfig, x: jax.Array, positions: jax.Array, rope: LayerRope
) -> tuple[jax.Array, ...]:
    """Projections, biases, q/k norms and RoPE. x: [b, t, hidden] -> q [b,t,heads,hd], k, v [b,t,kv,hd]
    (this device's heads)."""
    b, t, _ = x.shape
    q = matmul(x, attn.wq)
    k = matmul(x, attn.wk)
    v = matmul(x, attn.wv)
    if cfg.qkv_bias:
        q, k, v = q + attn.bq, k + attn.bk, v + attn.bv
    # heads from the projections' widths: under tensor parallelism a device holds only its own
    q = q.reshape(b, t, -1, cfg.head_dim)
    k = k.reshape(b, t, -1, cfg.head_dim)
    v = v.reshape(b, t, -1, cfg.head_dim)
    if cfg.qk_norm:
        q = norm(cfg, q, attn.q_norm)
        k = norm(cfg, k, attn.k_norm)
    return apply_rope(q, positions, rope.inv_freq, rope.scale), apply_rope(k, positions, rope.inv_freq, rope.scale), v


# the gated MLP's activations by config name (hidden_act / hidden_activation)
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def mlp(w: MlpWeights, y: jax.Array, act: str = "silu", shards: ModelShards = UNSPLIT) -> jax.Array:
    """The gated MLP. y: [..., hidden] (normalised) -> [..., hidden] (this device's partial sum
    when the MLP columns are split across `shards`)."""
    return matmul(_ACTIVATIONS[act](matmul(y, w.w_gate)) * matmul(y, w.w_up), w.w_down, shards)


def per_tile(fn: Callable[..., Any], tile: int | None, *xs: jax.Array, live: jax.Array | None = None) -> Any:
    """fn over `tile` tokens at a time (a loop over tiles), when tile divides the tokens.

    xs: [b, t, ...] (the same b and t); fn maps tiles [1, tile, ...] to a pytree of [1, tile, ...].
    Two reasons to tile a layer's per-token work (the projections, norms and MLP):
    - the same bits whatever the call: XLA:CPU compiles a product or a reduction by its operand's
      shape. A plain x @ w at SmolLM2's sizes gave rows that differed under 61 rows; SmolLM2's
      layers (attention left out) gave a token different bits in calls of 4,096 tokens or more
      than in one of 256 (which op moved was not isolated). With every call's tokens in tiles of
      one size, every product and norm a token takes part in has the same shape in every call.
      The tile's code must be the same too: XLA:CPU contracts `a * b + c` into one fused
      multiply-add (one rounding) as the fused code around it allows, and RoPE's queries and keys
      came out with other last bits in a call of one tile (its loop and slices compiled away)
      than in a call of two or more;
    - on a CPU the [tokens, intermediate] activations of a whole call (30 MB each for 10,240 tokens
      of a 768-wide MLP) spill out of the caches: alone, the MLP of 10,240 tokens ran 1.7x faster
      in tiles of 1,024 tokens.
    None: all at once (accelerators want the whole product).
    live: [b, t] bool, the tokens whose results are read (None: all): a tile with none of them
    (a bucket's padding) is not computed, and its outputs are zeros. A tile that runs computes
    every token in it, so a token's bits do not depend on which tiles run."""
    b, t = xs[0].shape[:2]
    if tile is None or (b * t) % tile:
        return fn(*xs)
    tiles = b * t // tile
    flat = tuple(x.reshape(b * t, *x.shape[2:]) for x in xs)
    wanted = None if live is None else live.reshape(tiles, tile).any(axis=1)  # the tiles holding a live token
    count = jnp.int32(tiles) if wanted is None else jnp.sum(wanted, dtype=jnp.int32)
    out = in_steps(lambda *s: jax.tree.map(lambda g: g[0], fn(*(a[None] for a in s))), tile, flat, count, wanted)
    return jax.tree.map(lambda o: o.reshape(b, t, *o.shape[1:]), out)


@struct.dataclass
class ReadRows:
    """The tokens a call reads its answers from (model/step.py: the output head's rows).

    The last layer's work after the attention (the o projection, the residual, the MLP) is
    needed at these tokens only: every other token's last output is read by nobody (its K/V,
    which later tokens do read, come before). run_layers computes it for these rows alone."""

    at: jax.Array  # [R] int32: each row's index in the token stream
    count: jax.Array  # [] int32: rows in use (the rest are padding)


def run_layers(
    params: Weights,
    cfg: ModelConfig,
    x: jax.Array,
    positions: jax.Array,
    attend: AttendFn,
    state: Any = None,
    token_tile: int | None = None,
    shards: ModelShards = UNSPLIT,
    live: jax.Array | None = None,
    read: ReadRows | None = None,
) -> tuple[jax.Array, Any]:
    """All decoder layers under one scan.

    x: [b, t, hidden]; positions: [b, t] or [t]. `attend(q, k, v, layer, state)` returns the
    attention output [b, t, heads, hd] and the new state: the state (e.g. the paged KV pool)
    is carried through the layers, so a layer can write into it in place before it reads.
    token_tile: run each layer's per-token work (everything but the attention) over this many
    tokens at a time (per_tile; None: all at once); live: [b, t] bool, the tokens whose results
    are read: tiles without one are skipped (per_tile; None: all).
    shards: the model axis (model/shards.py): with heads and MLP columns split, the o and down
    projections give partial sums, added up across devices (one all-reduce each per layer)
    before the bias and the residual.
    read (with token_tile; b = 1, R <= t): the last layer's work after its attention runs at
    these rows only: they are moved to the front of the stream and the rest of the layer runs
    the same tiles as every layer, over the tiles they fill (the others skipped as padding), so
    a row's bits depend on the tile's code and shape, the same in every call. A branch on the
    layer index picks the last layer's inputs: XLA:GPU reads a branch's predicate back on the
    host, so accelerators pass none.
    Returns the final hidden states [b, t, hidden] (with `read`: row i's at token i, i < R, and
    the tiles past the rows' as the last layer found them) and the final state.
    """
    inv_freq, scale = rope_tables(cfg)
    ropes = LayerRope(inv_freq=jnp.asarray(inv_freq), scale=jnp.asarray(scale))
    token_positions = jnp.broadcast_to(positions, x.shape[:2])  # tiled with the tokens
    all_live = jnp.ones(x.shape[:2], bool) if live is None else live

    def at_read_rows(h: jax.Array, out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """h and the attention output with the read rows first, and which tokens are live: the rows
        (the tokens past them keep what they held, and nothing reads them)."""
        assert read is not None

        def front(a: jax.Array) -> jax.Array:
            return a.at[0, : read.at.shape[0]].set(jnp.take(a[0], read.at, axis=0))

        return front(h), front(out), (jnp.arange(x.shape[1]) < read.count)[None]

    def layer(
        carry: tuple[jax.Array, Any], xs: tuple[LayerWeights, jax.Array, LayerRope]
    ) -> tuple[tuple[jax.Array, Any], None]:
        h, st = carry
        lw, index, rope = xs  # this layer's slice of the stacked weights, its index and RoPE

        def tiled(fn: Callable[..., Any], *xs: jax.Array, live: jax.Array = all_live) -> Any:
            return per_tile(fn, token_tile, *xs, live=live)

        def projections(h: jax.Array, at: jax.Array) -> tuple[jax.Array, ...]:
            return _qkv(lw.attn, cfg, norm(cfg, h, lw.attn_norm), at, rope)

        def o_projection(out: jax.Array) -> jax.Array:
            return matmul(out.reshape(*out.shape[:2], -1), lw.attn.wo, shards)

        # the partial sums of a split model are added up across devices on the whole token stream,
        # outside the tiles: one all-reduce per projection and layer, as many bytes as untiled
        with jax.named_scope("attention"):
            q, k, v = tiled(projections, h, token_positions)
            out, st = attend(q, k, v, index, st)
            rest_live = all_live
            if read is not None:  # the last layer goes on at the read rows only
                last = index == cfg.num_layers - 1
                h, out, rest_live = jax.lax.cond(last, at_read_rows, lambda h, out: (h, out, all_live), h, out)

            def post_norm(weight: jax.Array) -> Callable[[jax.Array], jax.Array]:
                return lambda x: tiled(lambda y: norm(cfg, y, weight), x, live=rest_live)

            attn_out = shards.sum(tiled(o_projection, out, live=rest_live))
            if cfg.out_bias:
                attn_out = attn_out + lw.attn.bo
            h = h + (post_norm(lw.attn_post_norm)(attn_out) if cfg.post_norms else attn_out)
        with jax.named_scope("mlp"):
            mlp_in = lambda x: mlp(lw.mlp, norm(cfg, x, lw.mlp_norm), cfg.hidden_act, shards)  # noqa: E731
            mlp_out = shards.sum(tiled(mlp_in, h, live=rest_live))
            h = h + (post_norm(lw.mlp_post_norm)(mlp_out) if cfg.post_norms else mlp_out)
        return (h, st), None

    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (h, state), _ = jax.lax.scan(layer, (x, state), (params.layers, layers, ropes))
    return h, state


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """Gemma 2's soft cap: cap * tanh(logits / cap) (None: unchanged)."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def label_probs(
    params: Weights,
    cfg: ModelConfig,
    h_last: jax.Array,
    label_ids: jax.Array,
    label_valid: jax.Array,
    apply_softmax: bool,
) -> jax.Array:
    """Label-token probabilities from each sequence's last hidden state.

    h_last: [b, hidden]; label_ids, label_valid: [labels] (padded to a bucket).
    apply_softmax=False: full-vocabulary probability exp(log_softmax(logits)[label]),
    which needs the whole vocabulary projection, but only at these b positions.
    apply_softmax=True: softmax over the valid label logits only, so only the
    label rows of the projection are computed. A head that scores its own rows (a classifier's,
    model/head.py): the raw logits of its rows label_ids. Returns [b, labels] float32.
    """
    head = output_head(cfg)
    h = norm(cfg, h_last, params.final_norm)
    w = params.projection(head)
    if head.own_rows:
        return jnp.einsum("bh,lh->bl", h, w[label_ids], preferred_element_type=jnp.float32)
    if apply_softmax:
        logits = softcap(
            jnp.einsum("bh,lh->bl", h, w[label_ids], preferred_element_type=jnp.float32), cfg.final_softcap
        )
        logits = jnp.where(label_valid, logits, -jnp.inf)
        return jax.nn.softmax(logits, axis=-1)
    logits = softcap(jnp.einsum("bh,vh->bv", h, w, preferred_element_type=jnp.float32), cfg.final_softcap)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.exp(jnp.take(logits, label_ids, axis=-1) - lse)


def embed(params: Weights, cfg: ModelConfig, tokens: jax.Array, shards: ModelShards = UNSPLIT) -> jax.Array:
    """tokens: [b, t] int32 -> [b, t, hidden] in the weights' dtype (from a vocabulary split
    by rows across the model axis: each device's rows, summed). Gemma scales them by
    sqrt(hidden), rounded to the weights' dtype first, as transformers does."""
    x = shards.take_rows(params.embed, tokens)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    return x
