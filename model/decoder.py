"""The decoder (Llama / Qwen2 / Qwen3 families) as free functions over typed weights.

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
import numpy as np

from prefixscore.model.config import ModelConfig
from prefixscore.model.shards import UNSPLIT, ModelShards
from prefixscore.model.weights import AttentionWeights, LayerWeights, MlpWeights, Weights

# attend(q [b,t,heads,hd], k [b,t,kv,hd], v [b,t,kv,hd], layer [] int32, state) -> ([b,t,heads,hd], state)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalise in float32, cast back, then scale. x: [..., dim]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, with llama3 scaling or a GGUF file's
    frequency factors if configured."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
    if cfg.rope_scaling:
        s = dict(cfg.rope_scaling)
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    if cfg.rope_freq_factors:  # llama.cpp divides each frequency by its factor
        inv = (inv / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. x: [b, t, heads, hd]; positions: [b, t] or [t] int32."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., t, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).astype(x.dtype)[..., None, :]
    sin = jnp.sin(emb).astype(x.dtype)[..., None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _qkv(attn: AttentionWeights, cfg: ModelConfig, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
    """Projections, biases, q/k norms and RoPE. x: [b, t, hidden] -> q [b,t,heads,hd], k, v [b,t,kv,hd]
    (this device's heads)."""
    b, t, _ = x.shape
    q = x @ attn.wq
    k = x @ attn.wk
    v = x @ attn.wv
    if cfg.qkv_bias:
        q, k, v = q + attn.bq, k + attn.bk, v + attn.bv
    # heads from the projections' widths: under tensor parallelism a device holds only its own
    q = q.reshape(b, t, -1, cfg.head_dim)
    k = k.reshape(b, t, -1, cfg.head_dim)
    v = v.reshape(b, t, -1, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, attn.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, attn.k_norm, cfg.rms_norm_eps)
    inv_freq = rope_inv_freq(cfg)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def mlp(w: MlpWeights, y: jax.Array) -> jax.Array:
    """The gated MLP. y: [..., hidden] (normalised) -> [..., hidden]."""
    return (jax.nn.silu(y @ w.w_gate) * (y @ w.w_up)) @ w.w_down


def tiled_mlp(w: MlpWeights, y: jax.Array, tile: int | None) -> jax.Array:
    """mlp() over `tile` tokens at a time (a loop), when tile divides the tokens.

    y: [b, t, hidden]. On a CPU the [tokens, intermediate] activations of a whole call (30 MB
    each for 10,240 tokens of a 768-wide MLP) spill out of the caches: alone, the MLP of
    10,240 tokens runs 1.7x faster in tiles of 1,024; inside whole calls W1 gained 2% and
    W4 5%. Accelerators want the whole product (tile None)."""
    b, t, hidden = y.shape
    if tile is None or t <= tile or (b * t) % tile:
        return mlp(w, y)
    return jax.lax.map(lambda part: mlp(w, part), y.reshape(b * t // tile, tile, hidden)).reshape(b, t, hidden)


def run_layers(
    params: Weights,
    cfg: ModelConfig,
    x: jax.Array,
    positions: jax.Array,
    attend: AttendFn,
    state: Any = None,
    mlp_tile: int | None = None,
    shards: ModelShards = UNSPLIT,
) -> tuple[jax.Array, Any]:
    """All decoder layers under one scan.

    x: [b, t, hidden]; positions: [b, t] or [t]. `attend(q, k, v, layer, state)` returns the
    attention output [b, t, heads, hd] and the new state: the state (e.g. the paged KV pool)
    is carried through the layers, so a layer can write into it in place before it reads.
    mlp_tile: run the MLP over this many tokens at a time (tiled_mlp; None: all at once).
    shards: the model axis (model/shards.py): with heads and MLP columns split, the o and down
    projections give partial sums, added up across devices (one all-reduce each per layer)
    before the bias and the residual.
    Returns the final hidden states [b, t, hidden] and the final state.
    """

    def layer(carry: tuple[jax.Array, Any], xs: tuple[LayerWeights, jax.Array]) -> tuple[tuple[jax.Array, Any], None]:
        h, st = carry
        lw, index = xs  # this layer's slice of the stacked weights
        with jax.named_scope("attention"):
            q, k, v = _qkv(lw.attn, cfg, rms_norm(h, lw.attn_norm, cfg.rms_norm_eps), positions)
            out, st = attend(q, k, v, index, st)
            b, t = h.shape[:2]
            attn_out = shards.sum(out.reshape(b, t, -1) @ lw.attn.wo)
            h = h + (attn_out + lw.attn.bo if cfg.out_bias else attn_out)
        with jax.named_scope("mlp"):
            h = h + shards.sum(tiled_mlp(lw.mlp, rms_norm(h, lw.mlp_norm, cfg.rms_norm_eps), mlp_tile))
        return (h, st), None

    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (h, state), _ = jax.lax.scan(layer, (x, state), (params.layers, layers))
    return h, state


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
    label rows of the projection are computed. A classifier (cfg.num_labels): the raw logits of
    its score rows label_ids. Returns [b, labels] float32.
    """
    h = rms_norm(h_last, params.final_norm, cfg.rms_norm_eps)
    if cfg.num_labels:  # a classifier: its raw logits (label_ids index its score rows)
        assert params.score is not None
        return jnp.einsum("bh,lh->bl", h, params.score[label_ids], preferred_element_type=jnp.float32)
    w = params.output
    if apply_softmax:
        logits = jnp.einsum("bh,lh->bl", h, w[label_ids], preferred_element_type=jnp.float32)
        logits = jnp.where(label_valid, logits, -jnp.inf)
        return jax.nn.softmax(logits, axis=-1)
    logits = jnp.einsum("bh,vh->bv", h, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.exp(jnp.take(logits, label_ids, axis=-1) - lse)


def embed(params: Weights, tokens: jax.Array, shards: ModelShards = UNSPLIT) -> jax.Array:
    """tokens: [b, t] int32 -> [b, t, hidden] in the weights' dtype (from a vocabulary split
    by rows across the model axis: each device's rows, summed)."""
    return shards.take_rows(params.embed, tokens)
