"""Rotary position embeddings: each layer's inverse frequencies and cos/sin scale, as
transformers' `ROPE_INIT_FUNCTIONS` compute them (default, linear, llama3, yarn), in numpy.

They are computed once per model on the host, in float32 like transformers, and enter the
compiled call as constants: one row per layer, so a model whose sliding layers use another
base (Gemma 3) runs every layer under the same scan.
"""

from __future__ import annotations

import math

import numpy as np

from prefixscore.model.config import ModelConfig


def _plain(theta: float, dim: int) -> np.ndarray:
    """1 / theta^(2i / dim) in float32 (transformers builds the exponent from an int64 arange)."""
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)


def _llama3(inv: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: dict, max_positions: int) -> tuple[np.ndarray, float]:
    """YaRN: frequencies blended between interpolated and extrapolated by a linear ramp over
    the dimensions, and cos/sin scaled by the attention factor."""
    factor = s.get("factor") or max_positions / s["original_max_position_embeddings"]
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    old_ctx = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32), float(attention)


def inv_freq(cfg: ModelConfig, theta: float, scaling: dict) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] float32 and the cos/sin scale of one RoPE setting."""
    dim = cfg.head_dim
    kind = scaling.get("rope_type", "default")
    if kind == "yarn":
        inv, attention = _yarn(theta, dim, scaling, cfg.max_position_embeddings)
    else:
        inv, attention = _plain(theta, dim), 1.0
        if kind == "linear":
            inv = (inv / scaling["factor"]).astype(np.float32)
        elif kind == "llama3":
            inv = _llama3(inv, scaling)
    if cfg.rope_freq_factors:  # llama.cpp divides each frequency by its factor
        inv = (inv / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    return inv, attention


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: inverse frequencies [layers, head_dim // 2] and cos/sin scales [layers], float32.

    Sliding layers of a model with a local base (Gemma 3) use plain RoPE at that base; every
    other layer uses rope_theta with the configured scaling."""
    full = inv_freq(cfg, cfg.rope_theta, dict(cfg.rope_scaling))
    local = full if cfg.rope_local_theta is None else inv_freq(cfg, cfg.rope_local_theta, {})
    rows = [local if window else full for window in cfg.layer_windows]
    return np.stack([r[0] for r in rows]), np.array([r[1] for r in rows], np.float32)
