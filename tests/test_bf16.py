"""bfloat16 end to end (weights, activations, KV cache) with float32 softmax, LSE, merge and
vocabulary normaliser: scores within 2e-2 of the float32 model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from prefixscore.model.buckets import Buckets
from prefixscore.model.engine import ScoringEngine

BUCKETS = Buckets(prefix=(128, 512), item=(16, 128), batch=(1, 64), max_batch_tokens=256)
TOL = 2e-2


def engines(loaded_f32, loaded_bf16) -> tuple[ScoringEngine, ScoringEngine]:
    return (
        ScoringEngine(loaded_f32.cfg, loaded_f32.params, "float32", BUCKETS),
        ScoringEngine(loaded_bf16.cfg, loaded_bf16.params, "bfloat16", BUCKETS),
    )


def compare(f32: ScoringEngine, bf16: ScoringEngine, vocab: int, labels: list[int]) -> dict[str, float]:
    rng = np.random.default_rng(0)
    query = rng.integers(0, vocab, 200).tolist()
    items = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 60, 40)]
    kv32, kv16 = f32.prefill(query), bf16.prefill(query)
    assert kv16.keys.dtype == jnp.bfloat16 and kv32.keys.dtype == jnp.float32
    out = {}
    for softmax in (True, False):
        a = f32.score_items(kv32, items, labels, softmax)
        b = bf16.score_items(kv16, items, labels, softmax)
        assert b.dtype == np.float32
        if softmax:
            out["label_softmax_abs"] = float(np.abs(a - b).max())
            out["label_softmax_mean"] = float(np.abs(a - b).mean())
        else:  # full-vocabulary probabilities are small; compare them relative to their size
            out["vocab_prob_rel"] = float((np.abs(a - b) / a).max())
    seqs = [query[:50] + it for it in items[:10]]
    out["item_first_abs"] = float(
        np.abs(f32.score_sequences(seqs, labels, True) - bf16.score_sequences(seqs, labels, True)).max()
    )
    return out


def test_bf16_matches_float32_tiny_random() -> None:
    from prefixscore.model.config import ModelConfig
    from prefixscore.model.loader import LoadedModel
    from prefixscore.model.weights import random_params

    cfg = ModelConfig(
        family="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    )
    m32 = LoadedModel("t", cfg, random_params(cfg, 0, jnp.float32), None, "float32")
    m16 = LoadedModel("t", cfg, random_params(cfg, 0, jnp.bfloat16), None, "bfloat16")
    errors = compare(*engines(m32, m16), cfg.vocab_size, [3, 17, 400])
    assert max(errors.values()) < TOL, errors


def test_bf16_matches_float32_real_weights() -> None:
    """SmolLM2-135M's real weights, where bf16 rounding shows: scores within 2e-2 on average
    and 4e-2 at worst. For scale: on these inputs transformers' own bfloat16 model differs
    from its float32 one by 0.0085 on average and 0.038 at worst (ours: 0.0067, 0.029);
    bfloat16 weights alone, evaluated in float32, account for 0.009 of the worst case."""
    pytest.importorskip("gguf")
    from prefixscore.model.loader import load_model

    try:
        m32, m16 = load_model("smollm2-135m", "float32"), load_model("smollm2-135m", "bfloat16")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    errors = compare(*engines(m32, m16), m32.cfg.vocab_size, [28, 314, 5000])
    assert errors["label_softmax_mean"] < TOL, errors
    assert errors["label_softmax_abs"] < 2 * TOL and errors["item_first_abs"] < 2 * TOL, errors
