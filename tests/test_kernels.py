"""Every attention fast path against the jax.numpy oracle (kernels/reference.py).

The Pallas kernels run in interpret mode on CPU: TPU kernels in the TPU
interpreter (`pltpu.force_tpu_interpret_mode`), GPU (Triton) kernels in Pallas'
generic interpreter. Real-hardware runs: tests/test_kernels_device.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from prefixscore.kernels import dispatch, reference

IMPLS = ["xla", "pallas_tpu", "pallas_gpu"]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@contextlib.contextmanager
def interpreted(name: str):
    if name == "pallas_tpu" and jax.default_backend() != "tpu":
        with pltpu.force_tpu_interpret_mode():
            yield
    else:
        yield


def rand(rng: np.random.Generator, *shape: int, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape), dtype)


def segments(lengths: list[int], n: int) -> jax.Array:
    """Items back to back, then padding as one more segment (what the engine packs)."""
    seg = np.full(n, len(lengths), np.int32)
    at = 0
    for i, length in enumerate(lengths):
        seg[at : at + length] = i
        at += length
    return jnp.asarray(seg)


def close(a: jax.Array, b: jax.Array, dtype) -> None:
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("prefix_len", [1, 300, 512])
def test_prefix_attention(impl: str, prefix_len: int) -> None:
    rng = np.random.default_rng(prefix_len)
    n, heads, kv, d, s = 256, 4, 2, 64, 512
    q, pk, pv = rand(rng, n, heads, d), rand(rng, s, kv, d), rand(rng, s, kv, d)
    want_out, want_lse = reference.prefix_attention(q, pk, pv, prefix_len)
    with interpreted(impl):
        out, lse = dispatch.get(impl).prefix_attention(q, pk, pv, jnp.int32(prefix_len))
    assert lse.dtype == jnp.float32 and lse.shape == (n, heads)
    close(out, want_out, jnp.float32)
    close(lse, want_lse, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_attention_empty_prefix_merges_to_items_only(impl: str) -> None:
    """prefix_len 0 (whole sequences): the prefix part must weigh nothing in the merge."""
    rng = np.random.default_rng(1)
    n, heads, kv, d, s = 128, 4, 2, 64, 512
    q, k, v = rand(rng, n, heads, d), rand(rng, n, kv, d), rand(rng, n, kv, d)
    pk, pv = rand(rng, s, kv, d), rand(rng, s, kv, d)
    seg = segments([30, 60, 38], n)
    want = reference.ragged_item_attention(q, k, v, seg)[0]
    with interpreted(impl):
        got = dispatch.get(impl).ragged_shared_prefix_attention(q, k, v, seg, 60, pk, pv, jnp.int32(0))
    assert np.isfinite(np.asarray(got)).all()
    close(got, want, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lengths", [[5, 70, 1, 20, 130, 3], [256], [64] * 4, [1] * 200])
def test_ragged_item_attention(impl: str, lengths: list[int]) -> None:
    rng = np.random.default_rng(len(lengths))
    n, heads, kv, d = 256, 4, 2, 64
    q, k, v = rand(rng, n, heads, d), rand(rng, n, kv, d), rand(rng, n, kv, d)
    seg = segments(lengths, n)
    want_out, want_lse = reference.ragged_item_attention(q, k, v, seg)
    with interpreted(impl):
        out, lse = dispatch.get(impl).ragged_item_attention(q, k, v, seg, jnp.int32(max(lengths)))
    close(out, want_out, jnp.float32)
    close(lse, want_lse, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_shared_prefix_attention(impl: str, dtype) -> None:
    """The whole item-side attention: prefix part + item part + merge, grouped-query (group 4)."""
    rng = np.random.default_rng(7)
    n, heads, kv, d, s = 256, 8, 2, 64, 1024
    q, k, v = rand(rng, n, heads, d, dtype=dtype), rand(rng, n, kv, d, dtype=dtype), rand(rng, n, kv, d, dtype=dtype)
    pk, pv = rand(rng, s, kv, d, dtype=dtype), rand(rng, s, kv, d, dtype=dtype)
    seg = segments([20] * 12, n)
    want = reference.ragged_shared_prefix_attention(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        seg,
        20,
        pk.astype(jnp.float32),
        pv.astype(jnp.float32),
        700,
    )
    with interpreted(impl):
        got = dispatch.get(impl).ragged_shared_prefix_attention(q, k, v, seg, jnp.int32(20), pk, pv, jnp.int32(700))
    assert got.dtype == dtype
    close(got, want, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_attention_and_item_attention(impl: str) -> None:
    """The prefill chunk's causal part, and padded item batches over a prefix."""
    rng = np.random.default_rng(3)
    b, t, heads, kv, d, s = 2, 128, 4, 2, 64, 512
    q, k, v = rand(rng, b, t, heads, d), rand(rng, b, t, kv, d), rand(rng, b, t, kv, d)
    pk, pv = rand(rng, s, kv, d), rand(rng, s, kv, d)
    want_out, want_lse = reference.item_attention(q, k, v)
    with interpreted(impl):
        m = dispatch.get(impl)
        out, lse = m.item_attention(q, k, v)
        causal = m.causal_attention(q, k, v)
        shared = m.shared_prefix_attention(q, k, v, pk, pv, jnp.int32(200))
    close(out, want_out, jnp.float32)
    close(lse, want_lse, jnp.float32)
    close(causal, want_out, jnp.float32)
    close(shared, reference.shared_prefix_attention(q, k, v, pk, pv, 200), jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_attention(impl: str) -> None:
    rng = np.random.default_rng(5)
    oa, ob = rand(rng, 64, 4, 64), rand(rng, 64, 4, 64)
    la, lb = rand(rng, 64, 4) * 5, rand(rng, 64, 4) * 5
    lb = lb.at[0].set(reference.MASK_VALUE)  # a part that saw no key weighs nothing
    with interpreted(impl):
        got = dispatch.get(impl).merge_attention(oa, la, ob, lb)
    close(got, reference.merge_attention(oa, la, ob, lb), jnp.float32)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_untileable_shapes_fall_back(impl: str) -> None:
    """Token counts and head dims a kernel cannot tile still give the right answer (XLA path)."""
    rng = np.random.default_rng(9)
    n, heads, kv, d, s = 50, 4, 2, 16, 64
    q, k, v = rand(rng, n, heads, d), rand(rng, n, kv, d), rand(rng, n, kv, d)
    pk, pv = rand(rng, s, kv, d), rand(rng, s, kv, d)
    seg = segments([7, 13, 30], n)
    want = reference.ragged_shared_prefix_attention(q, k, v, seg, 30, pk, pv, 40)
    with interpreted(impl):
        got = dispatch.get(impl).ragged_shared_prefix_attention(q, k, v, seg, jnp.int32(30), pk, pv, jnp.int32(40))
    close(got, want, jnp.float32)


def test_dispatch_names_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dispatch.resolve(backend="cpu") == "xla"
    assert dispatch.resolve(backend="tpu") == "pallas_tpu"
    assert dispatch.resolve(backend="gpu") == "pallas_gpu"
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "reference")
    assert dispatch.resolve(backend="tpu") == "reference"
    assert dispatch.resolve("pallas_gpu") == "pallas_gpu"  # explicit beats the environment
    with pytest.raises(ValueError, match="unknown"):
        dispatch.resolve("nope")
    for name in dispatch.IMPLEMENTATIONS:
        module = dispatch.get(name)
        for fn in (
            "prefix_attention",
            "ragged_item_attention",
            "item_attention",
            "merge_attention",
            "ragged_shared_prefix_attention",
            "shared_prefix_attention",
            "causal_attention",
        ):
            assert callable(getattr(module, fn)), (name, fn)
