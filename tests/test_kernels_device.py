"""The backend's own attention kernels compiled for real (not interpreted), against the oracle,
and the whole engine on the accelerator against the CPU. Skipped without a GPU or TPU.

Run on a GPU/TPU machine: pytest tests/test_kernels_device.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixscore.kernels import dispatch, reference, selfcheck
from prefixscore.kernels.paged import causal_by_region

BACKEND = jax.default_backend()
pytestmark = pytest.mark.skipif(BACKEND not in ("gpu", "tpu"), reason="needs a GPU or TPU")
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
QWEN3_06B = (16, 8, 128)  # heads, kv heads, head_dim
ARRAYS = ("q", "k", "v", "pool_k", "pool_v")


@pytest.fixture(autouse=True)
def exact_f32_matmuls():
    # GPUs default to TF32 for float32 matmuls in XLA: keep the reference exact
    with jax.default_matmul_precision("highest"):
        yield


def close(got: jax.Array, want: jax.Array, tol: float) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_kernels_match_reference_qwen3_shapes(dtype: str) -> None:
    """Qwen3-0.6B head layout (16 query heads, 8 kv heads, head_dim 128) on selfcheck's stream:
    a prefill chunk over its query's earlier pages, items of three queries over out-of-order
    pages, whole sequences over no prefix, padding."""
    name = dispatch.resolve(backend=BACKEND)
    impl = dispatch.get(name)
    x = selfcheck.case(*QWEN3_06B, dtype)
    meta = x["meta"]
    f32 = {n: x[n].astype(jnp.float32) for n in ARRAYS}  # the oracle at full precision
    tol = TOL[dtype]

    got = jax.jit(impl.paged_attention)(*(x[n] for n in ARRAYS), meta)
    want = jax.jit(reference.paged_attention)(*(f32[n] for n in ARRAYS), meta)
    assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
    read = selfcheck.read_rows(meta)  # padding's outputs are never read
    close(np.asarray(got, np.float32)[read], np.asarray(want)[read], tol)

    # the prefix part on its own: rows that have a prefix match; the others must weigh 0 in the merge
    out_p, lse_p = jax.jit(impl.paged_prefix_attention)(x["q"], x["pool_k"], x["pool_v"], meta)
    want_p, want_lse = jax.jit(reference.paged_prefix_attention)(f32["q"], f32["pool_k"], f32["pool_v"], meta)
    assert lse_p.dtype == jnp.float32 and lse_p.shape == want_lse.shape
    # padding rows (read is False) continue their segment but their outputs are unspecified
    has_prefix = np.asarray(jnp.take(meta.prefix_len, meta.segment_ids)) > 0
    close(np.asarray(out_p, np.float32)[has_prefix & read], np.asarray(want_p)[has_prefix & read], tol)
    close(np.asarray(lse_p)[has_prefix & read], np.asarray(want_lse)[has_prefix & read], tol)
    assert (np.asarray(lse_p)[~has_prefix & read] <= reference.MASK_VALUE / 2).all()

    # the causal part, per region of the stream
    ragged = lambda impl: lambda q, k, v: causal_by_region(impl.ragged_item_attention, q, k, v, meta)  # noqa: E731
    out_i, lse_i = jax.jit(ragged(impl))(x["q"], x["k"], x["v"])
    want_i, want_lse_i = jax.jit(ragged(reference))(f32["q"], f32["k"], f32["v"])
    close(np.asarray(out_i, np.float32)[read], np.asarray(want_i)[read], tol)
    close(np.asarray(lse_i)[read], np.asarray(want_lse_i)[read], tol)

    # and what the server checks before it reports SERVING
    errors = selfcheck.verify(name, impl, *QWEN3_06B, dtype)
    assert max(errors.values()) <= selfcheck.TOLERANCE[dtype]


@pytest.mark.parametrize("model", ["tiny-qwen3", "gemma3_text"])
def test_engine_on_device_matches_cpu(model: str, hf_checkpoints) -> None:
    """Scores on the accelerator (its default attention) equal the CPU engine's, through the
    service's device path (prefix cache, batcher, planned calls): a 300-token query in two
    prefill chunks, 50 items of mixed lengths over several calls, softmax both ways, whole
    sequences. tiny-qwen3 (its weights without its tokenizer, which token ids do not need) and a
    Gemma 3 checkpoint: a 48-token window on one layer, soft caps, a query scale."""
    from prefixscore.engine.loop.request import TokenizedRequest
    from prefixscore.engine.requests.answers import label_scores
    from prefixscore.engine.runtime.buckets import Buckets
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.engine.scorer import EngineRunner
    from prefixscore.model import presets
    from prefixscore.model.loader import load_model
    from prefixscore.model.weights import random_params

    if model in presets.RANDOM_PRESETS:
        cfg = presets.RANDOM_PRESETS[model][0]
        params = random_params(cfg, presets.RANDOM_SEED, jnp.float32)
    else:
        loaded = load_model(str(hf_checkpoints[model][0]))
        cfg, params = loaded.cfg, loaded.params
        assert any(cfg.layer_windows)
    buckets = Buckets(context=512, max_batch_tokens=512, prefill_chunk=256, max_prefill_tokens=512)
    cpu = jax.devices("cpu")[:1]
    pool = 64 << 20
    on_device = ScoringEngine(cfg, params, "float32", buckets, pool_bytes=pool)
    on_cpu = ScoringEngine(cfg, params, "float32", buckets, attn_impl="xla", devices=cpu, pool_bytes=pool)
    assert on_device.devices[0].platform != "cpu" and on_device.attn_impl != "xla"
    rng = np.random.default_rng(1)
    query = tuple(rng.integers(0, cfg.vocab_size, 300).tolist())
    items = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 60, 50)]
    labels = (28, cfg.vocab_size - 1)
    reqs = [
        TokenizedRequest(query, items, labels, label_scores(False), False),
        TokenizedRequest(query, items, labels, label_scores(True), False),
        TokenizedRequest((), [it + list(query[:40]) for it in items[:10]], labels, label_scores(True), True),
    ]
    got, _ = EngineRunner(on_device).score_requests(reqs)
    want, _ = EngineRunner(on_cpu).score_requests(reqs)
    assert on_device.stats["calls"] > 1 and on_device.stats["prefill_tokens"] == len(query)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
