"""The tests' independent picture of 8-bit projections (docs/design.md, "8-bit weights"): a float64
numpy forward of a Qwen3 decoder whose every projection is quantized here, from the original
float weights, by the published scheme, with this file's own constants and its own RoPE (no value
or table of prefixscore.model.quant or prefixscore.model.rope is read).

The scheme, as vLLM and compressed-tensors publish it: one weight scale per output channel,
max |w| / 127 (int8) or / 448 (fp8 e4m3), computed in float32; int8 values are round-half-to-even
of w / scale, fp8 values w / scale clipped to +-448 and converted by torch's float8_e4m3fn cast
(round to nearest even). W8A8 (dynamic) quantizes each token's activations the same way with
scale max |x| / 127 (or / 448; 1 for an all-zero token), multiplies the 8-bit operands and rescales
by both scales; W8A16 multiplies by the dequantized weights.
"""

from __future__ import annotations

import numpy as np
import torch

INT8, FP8 = "int8", "fp8"
# the largest magnitude each kind quantizes to: the int8 range's +-127, e4m3's largest finite value
PUBLISHED_QMAX = {INT8: 127.0, FP8: 448.0}


def to_fp8(a: np.ndarray) -> np.ndarray:
    """`a` rounded to float8_e4m3fn by torch's cast (not ml_dtypes', which the engine uses), as float64."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.float8_e4m3fn).to(torch.float64).numpy()


def _rounded(scaled: np.ndarray, kind: str) -> np.ndarray:
    return np.round(scaled) if kind == INT8 else to_fp8(scaled)  # numpy rounds half to even


def quantize_channels(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A float weight [in, out] as (8-bit values as float64 [in, out], float32 scales [1, out] as
    float64): the published per-channel rounding, in float32 as a quantizer computes it."""
    w = np.asarray(w, np.float32)
    qmax = np.float32(PUBLISHED_QMAX[kind])
    top = np.abs(w).max(axis=0, keepdims=True)
    scale = np.where(top > 0, top / qmax, np.float32(1)).astype(np.float32)
    scaled = np.clip(w / scale, -qmax, qmax)
    return _rounded(scaled, kind).astype(np.float64), scale.astype(np.float64)


def reference_matmul(
    x: np.ndarray, w: np.ndarray, kind: str, activations: str, near_ties: list | None = None
) -> np.ndarray:
    """x [..., in] (float64) @ the float weight w [in, out] quantized here. activations "none": W8A16
    (the dequantized weight), "dynamic": per-token 8-bit activations. near_ties: gets the numbers of
    activations that a relative change of 1e-7 and of 1e-6 rounds otherwise (float32 noise is
    about 1e-7)."""
    values, scale = quantize_channels(w, kind)
    if activations == "none":
        return x @ (values * scale)
    assert activations == "dynamic", activations
    qmax = PUBLISHED_QMAX[kind]
    top = np.max(np.abs(x), axis=-1, keepdims=True)
    x_scale = np.where(top > 0, top / qmax, 1.0)
    scaled = np.clip(x / x_scale, -qmax, qmax)
    if near_ties is not None:
        for eps in (1e-7, 1e-6):
            moved = _rounded(scaled * (1 + eps), kind) != _rounded(scaled * (1 - eps), kind)
            near_ties.append((eps, int(moved.sum())))
    return (_rounded(scaled, kind) @ values) * x_scale * scale


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return np.asarray(weight, np.float64) * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE (transformers' default rotary embedding: inverse frequencies formed in
    float32 as it forms them) on x [t, heads, hd]."""
    hd = x.shape[-1]
    inv_freq = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))).astype(np.float64)
    angles = np.concatenate([positions[:, None] * inv_freq[None, :]] * 2, axis=-1)[:, None, :]
    half = hd // 2
    return x * np.cos(angles) + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * np.sin(angles)


def reference_log_probs(
    cfg, params, tokens: list[int], kind: str, activations: str, near_ties: list | None = None
) -> np.ndarray:
    """A plain float64 forward of one whole sequence (Qwen3, default RoPE: RMSNorm, q/k norms, GQA
    causal attention, SiLU MLP, final norm, tied head), every projection by `reference_matmul` from
    `params`, the full-precision weights on the host ([layers, in, out] projections); the
    full-vocabulary log-softmax at the last token [vocab]."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    eps, t = cfg.rms_norm_eps, len(tokens)
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    assert cfg.family == "qwen3" and cfg.qk_norm and not cfg.qkv_bias and cfg.attn_scale is None
    assert not dict(cfg.rope_scaling) and cfg.rope_local_theta is None and params.lm_head is None
    positions = np.arange(t, dtype=np.float64)
    causal = np.tril(np.ones((t, t), bool))
    layers = params.layers

    def proj(x: np.ndarray, name: str, layer: int) -> np.ndarray:
        group, field = name.split(".")
        return reference_matmul(x, getattr(getattr(layers, group), field)[layer], kind, activations, near_ties)

    h = f64(params.embed)[tokens]
    for i in range(cfg.num_layers):
        y = _rms_norm(h, layers.attn_norm[i], eps)
        q = _rms_norm(proj(y, "attn.wq", i).reshape(t, heads, hd), layers.attn.q_norm[i], eps)
        k = _rms_norm(proj(y, "attn.wk", i).reshape(t, kv_heads, hd), layers.attn.k_norm[i], eps)
        v = proj(y, "attn.wv", i).reshape(t, kv_heads, hd)
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)  # GQA
        logits = np.where(causal, np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd), -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        h = h + proj(np.einsum("hqk,khd->qhd", weights, v).reshape(t, heads * hd), "attn.wo", i)
        y = _rms_norm(h, layers.mlp_norm[i], eps)
        gate, up = proj(y, "mlp.w_gate", i), proj(y, "mlp.w_up", i)
        h = h + proj(gate / (1.0 + np.exp(-gate)) * up, "mlp.w_down", i)
    logits = f64(params.embed) @ _rms_norm(h[-1], params.final_norm, eps)
    top = logits.max()
    return logits - top - np.log(np.exp(logits - top).sum())


def full_precision_params(model: str):
    """A random preset's full-precision weights on the host (what `--quantize int8|fp8` quantizes)."""
    import jax
    import jax.numpy as jnp

    from prefixscore.model.presets import RANDOM_PRESETS, RANDOM_SEED
    from prefixscore.model.weights import random_params

    return jax.device_get(random_params(RANDOM_PRESETS[model][0], RANDOM_SEED, jnp.float32))
