"""The backend's own attention kernels compiled for real (not interpreted), against the oracle,
and the whole engine on the accelerator against the CPU. Skipped without a GPU or TPU.

Run on a GPU/TPU machine: pytest tests/test_kernels_device.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixscore.kernels import dispatch, reference

BACKEND = jax.default_backend()
pytestmark = pytest.mark.skipif(BACKEND not in ("gpu", "tpu"), reason="needs a GPU or TPU")
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def rand(rng: np.random.Generator, *shape: int, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape), dtype)


@pytest.fixture(autouse=True)
def exact_f32_matmuls():
    # GPUs default to TF32 for float32 matmuls in XLA: keep the reference exact
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backend_kernels_match_reference_qwen3_shapes(dtype) -> None:
    """Qwen3-0.6B head layout (16 query heads, 8 kv heads, head_dim 128), W1-like stream."""
    impl = dispatch.get(dispatch.resolve(backend=BACKEND))
    rng = np.random.default_rng(0)
    n, heads, kv, d, s = 2048, 16, 8, 128, 2048
    q, k, v = (rand(rng, n, h, d, dtype=dtype) for h in (heads, kv, kv))
    pk, pv = rand(rng, s, kv, d, dtype=dtype), rand(rng, s, kv, d, dtype=dtype)
    seg = jnp.asarray(np.minimum(np.arange(n) // 20, 10**6), jnp.int32)
    f32 = lambda x: x.astype(jnp.float32)
    tol = TOL[dtype]

    out, lse = jax.jit(impl.prefix_attention)(q, pk, pv, jnp.int32(2000))
    want_out, want_lse = reference.prefix_attention(f32(q), f32(pk), f32(pv), 2000)
    np.testing.assert_allclose(np.asarray(f32(out)), np.asarray(want_out), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=tol, rtol=tol)

    out, lse = jax.jit(impl.ragged_item_attention)(q, k, v, seg, jnp.int32(20))
    want_out, want_lse = reference.ragged_item_attention(f32(q), f32(k), f32(v), seg)
    np.testing.assert_allclose(np.asarray(f32(out)), np.asarray(want_out), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=tol, rtol=tol)

    got = jax.jit(impl.ragged_shared_prefix_attention)(q, k, v, seg, jnp.int32(20), pk, pv, jnp.int32(2000))
    want = reference.ragged_shared_prefix_attention(f32(q), f32(k), f32(v), seg, 20, f32(pk), f32(pv), 2000)
    np.testing.assert_allclose(np.asarray(f32(got)), np.asarray(want), atol=tol, rtol=tol)

    b, t = 1, 1024
    qc, kc, vc = q[:t].reshape(b, t, heads, d), k[:t].reshape(b, t, kv, d), v[:t].reshape(b, t, kv, d)
    got = jax.jit(impl.causal_attention)(qc, kc, vc)
    want = reference.causal_attention(f32(qc), f32(kc), f32(vc))
    np.testing.assert_allclose(np.asarray(f32(got)), np.asarray(want), atol=tol, rtol=tol)


def test_engine_on_device_matches_cpu() -> None:
    """tiny-qwen3 scores on the accelerator (its default attention) equal the CPU engine's."""
    from prefixscore.model.buckets import Buckets
    from prefixscore.model.engine import ScoringEngine
    from prefixscore.model.loader import load_model

    loaded = load_model("tiny-qwen3")
    buckets = Buckets(prefix=(512,), item=(64,), batch=(1, 64), max_batch_tokens=1024)
    cpu = jax.devices("cpu")[:1]
    on_device = ScoringEngine(loaded.cfg, loaded.params, "float32", buckets)
    on_cpu = ScoringEngine(loaded.cfg, loaded.params, "float32", buckets, attn_impl="xla", devices=cpu)
    rng = np.random.default_rng(1)
    query = rng.integers(0, loaded.cfg.vocab_size, 300).tolist()
    items = [rng.integers(0, loaded.cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 60, 50)]
    for softmax in (False, True):
        a = on_device.score_items(on_device.prefill(query), items, [28, 1017], softmax)
        b = on_cpu.score_items(on_cpu.prefill(query), items, [28, 1017], softmax)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
