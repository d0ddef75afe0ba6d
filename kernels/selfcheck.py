"""Start-up check of an attention implementation against the oracle, on the device it serves from.

The fast paths are tested on CPU (interpret mode, and lowered for their backends), but
a backend compiler can still miscompile a kernel on the hardware it meets. The server
runs this once before it reports SERVING: the two calls the model makes per layer
(packed items over a prefix, and the prefill's chunk) at the model's head shapes and
dtype, on inputs the kernels tile without falling back, compared with
kernels/reference.py computed on the same device at full precision. A mismatch stops
start-up with a message naming the function, instead of serving wrong scores.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from prefixscore.kernels import reference

# max |fast - reference| allowed, by dtype (the kernel tests' budgets)
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
PREFIX_KEYS = 512  # a whole block of every prefix kernel; 300 of them are real
STREAM_TOKENS = 256  # packed items: a multiple of every kernel's token block
ITEM_LENGTHS = (1, 20, 63, 64, 65, 40)  # items across block edges; the rest is one padding segment


class KernelCheckFailed(RuntimeError):
    """The attention implementation disagrees with the reference on this device."""


def _inputs(heads: int, kv_heads: int, head_dim: int, dtype: jnp.dtype, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    segments = np.repeat(np.arange(len(ITEM_LENGTHS)), ITEM_LENGTHS)
    segments = np.concatenate([segments, np.full(STREAM_TOKENS - len(segments), len(ITEM_LENGTHS))])
    return {
        "q": normal(STREAM_TOKENS, heads, head_dim),
        "k": normal(STREAM_TOKENS, kv_heads, head_dim),
        "v": normal(STREAM_TOKENS, kv_heads, head_dim),
        "segment_ids": jnp.asarray(segments, jnp.int32),
        "prefix_k": normal(PREFIX_KEYS, kv_heads, head_dim),
        "prefix_v": normal(PREFIX_KEYS, kv_heads, head_dim),
        "prefix_len": jnp.int32(300),
    }


def _calls(impl: ModuleType, x: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The attention the decoder runs, through `impl`: items over a prefix, and a prefill chunk
    (its causal part over itself, [1, t, heads, d], merged with its prefix part)."""
    items = impl.ragged_shared_prefix_attention(
        x["q"], x["k"], x["v"], x["segment_ids"], max(ITEM_LENGTHS), x["prefix_k"], x["prefix_v"], x["prefix_len"]
    )
    out_p, lse_p = impl.prefix_attention(x["q"], x["prefix_k"], x["prefix_v"], x["prefix_len"])
    out_c, lse_c = impl.item_attention(x["q"][None], x["k"][None], x["v"][None])
    chunk = impl.merge_attention(out_p[None], lse_p[None], out_c, lse_c)[0]
    return {"ragged_shared_prefix_attention": items, "prefill_chunk_attention": chunk}


def check(impl: ModuleType, heads: int, kv_heads: int, head_dim: int, dtype: str, *, seed: int = 0) -> dict[str, float]:
    """Max |impl - reference| per call, computed on the default device. Pure: raises nothing."""
    x = _inputs(heads, kv_heads, head_dim, jnp.dtype(dtype), seed)
    fast = jax.jit(lambda a: _calls(impl, a))(x)
    with jax.default_matmul_precision("highest"):  # no TF32 in the oracle on GPUs
        exact = jax.jit(lambda a: _calls(reference, a))(x)
    # on the host: XLA's max reduction may skip NaNs, numpy's propagates them
    diff = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))  # noqa: E731
    return {name: diff(fast[name], exact[name]) for name in fast}


def verify(impl_name: str, impl: ModuleType, heads: int, kv_heads: int, head_dim: int, dtype: str) -> dict[str, float]:
    """check(), raising KernelCheckFailed (naming the call and the way out) past the tolerance."""
    errors = check(impl, heads, kv_heads, head_dim, dtype)
    bad = {name: err for name, err in errors.items() if not err <= TOLERANCE[dtype]}  # NaN fails too
    if bad:
        detail = ", ".join(f"{name} off by {err:.3g}" for name, err in bad.items())
        raise KernelCheckFailed(
            f"attention implementation {impl_name!r} disagrees with the reference on "
            f"{jax.default_backend()} ({dtype}, {heads} heads / {kv_heads} kv heads / head_dim {head_dim}): "
            f"{detail} (tolerance {TOLERANCE[dtype]}); serve with --attention xla and report this"
        )
    return errors
