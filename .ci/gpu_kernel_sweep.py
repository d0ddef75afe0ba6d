"""Times the GPU attention kernels (kernels/pallas_gpu.py) at W1's shapes over block and pipeline
settings, each checked against the reference first. Run on a GPU machine:

    python .ci/gpu_kernel_sweep.py            # prints a table, best first

W1 per layer: 10,240 item tokens of Qwen3-0.6B (16 query heads, 8 kv heads, head_dim 128,
bfloat16) against a 2,000-token prefix in the paged pool, and their causal item part.
"""

from __future__ import annotations

import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from prefixscore.kernels import pallas_gpu as gpu
from prefixscore.kernels import reference
from prefixscore.kernels.paged import NO_WINDOW, PagedAttentionMeta

T, HEADS, KV, D, LAYERS, PAGE, PREFIX, ITEM = 10240, 16, 8, 128, 28, 128, 2000, 20
SEGMENTS, MAX_PAGES, POOL_PAGES = 4, 32, 64


def inputs():
    rng = np.random.default_rng(0)
    k0, k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(k0, (T, HEADS, D), jnp.bfloat16)
    k = jax.random.normal(k1, (T, KV, D), jnp.bfloat16)
    v = jax.random.normal(k2, (T, KV, D), jnp.bfloat16)
    pool_k = jax.random.normal(k3, (LAYERS, KV, POOL_PAGES, PAGE, D), jnp.bfloat16)
    pool_v = jax.random.normal(k4, (LAYERS, KV, POOL_PAGES, PAGE, D), jnp.bfloat16)
    table = np.zeros((SEGMENTS, MAX_PAGES), np.int32)
    table[0, :16] = rng.permutation(POOL_PAGES)[:16]
    meta = PagedAttentionMeta(
        segment_ids=jnp.zeros(T, jnp.int32),
        item_ids=jnp.asarray(np.arange(T) // ITEM, jnp.int32),
        page_table=jnp.asarray(table),
        prefix_len=jnp.asarray([PREFIX, 0, 0, 0], jnp.int32),
        max_chunk_len=jnp.int32(0),
        max_item_len=jnp.int32(ITEM),
        layer=jnp.int32(5),
        positions=jnp.asarray(PREFIX + np.arange(T) % ITEM, jnp.int32),  # after the prefix, per item
        window=jnp.int32(NO_WINDOW),
        split=0,
    )
    return q, k, v, pool_k, pool_v, meta


def timed(fn, *args, repeats: int = 30) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    q, k, v, pool_k, pool_v, meta = inputs()
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want_p, _ = jax.jit(reference.paged_prefix_attention)(f32(q), f32(pool_k), f32(pool_v), meta)
    prefix_flops = 4 * T * PREFIX * D * HEADS
    rows = []
    for block_k, stages, warps in itertools.product((64, 128), (2, 3), (4, 8)):
        gpu.BLOCK_K, gpu.PREFIX_STAGES, gpu.NUM_WARPS = block_k, stages, warps
        try:
            fn = jax.jit(gpu.paged_prefix_attention)
            got, _ = fn(q, pool_k, pool_v, meta)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want_p)))
            sec = timed(fn, q, pool_k, pool_v, meta)
            rows.append(("prefix", block_k, stages, warps, sec * 1e3, prefix_flops / sec / 1e12, err))
        except Exception as e:  # a setting Triton cannot compile (shared memory): report it, go on
            rows.append(("prefix", block_k, stages, warps, float("nan"), 0.0, f"{type(e).__name__}: {str(e)[:80]}"))
    gpu.BLOCK_K = 64
    for stages, warps in itertools.product((2, 3), (4, 8)):
        gpu.ITEM_STAGES, gpu.NUM_WARPS = stages, warps
        fn = jax.jit(gpu.ragged_item_attention)
        sec = timed(fn, q, k, v, meta.item_ids, ITEM)
        rows.append(("item", gpu.ITEM_BLOCK, stages, warps, sec * 1e3, 0.0, ""))
    print(f"{'kernel':8} {'block_k':>7} {'stages':>6} {'warps':>5} {'ms':>8} {'TFLOP/s':>8}  max err")
    for r in sorted(rows, key=lambda r: (r[0], r[4])):
        print(f"{r[0]:8} {r[1]:7} {r[2]:6} {r[3]:5} {r[4]:8.3f} {r[5]:8.1f}  {r[6]}")


if __name__ == "__main__":
    main()
