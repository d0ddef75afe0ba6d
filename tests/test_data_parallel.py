"""Data parallelism: weights and prefix KV replicated, the query prefill split along the
sequence, item streams split across devices; scores as on one device. On CPU with 8
simulated devices.

Item streams cut identically give bit-identical scores. A split prefill runs each
layer's matmuls on 1/8 of the rows, which XLA may round differently in the last bit,
so prefix KV and scores over it agree to float32 rounding (1e-6), not bit for bit.

`--xla_force_host_platform_device_count` must be set before jax starts, so the test
runs this file as a script in a subprocess (the main suite triggers it; no separate
pytest invocation is needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

DEVICES = 8


def test_eight_devices_score_like_one() -> None:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["devices"] == DEVICES
    assert result["calls_spanning_devices"] > 0  # the multi-device engine really split streams
    assert result["prefill_split"] == {"128": 1, "1024": DEVICES}  # 16-token slices would be too thin
    assert result["prefill_kv_max_abs_diff"] <= 1e-5
    for case, diff in result["max_abs_diff"].items():
        assert diff <= (0.0 if case == "item_first" else 1e-6), (case, diff)
    assert result["steady_state_compilations"] == 0
    # the 8-device split prefill and item calls lower with the real TPU and GPU kernels too
    for call, names in result["lowered_kernels"].items():
        assert {"_prefix_kernel", "_ragged_kernel"} <= set(names), (call, names)


def lower_for_accelerators(cfg) -> dict[str, list[str]]:
    """Lower the 8-device prefill and item calls for a TPU slice and for GPUs (see
    tests/test_kernels_lowering.py) at the production head shapes: collectives and kernels together."""
    import dataclasses
    import re

    import jax.numpy as jnp

    from prefixscore.model.engine import ScoringEngine
    from prefixscore.model.weights import random_params

    shaped = dataclasses.replace(cfg, hidden_size=256, num_heads=16, num_kv_heads=8, head_dim=128, num_layers=1)
    out = {}
    for impl, platform in (("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")):
        engine = ScoringEngine(shaped, random_params(shaped, 0, jnp.bfloat16), "bfloat16", attn_impl=impl)
        for key in (("prefill", 1024), ("items", 1024, 1024, 256)):
            text = engine.lower_for(key, platform).as_text()
            out[f"{platform}/{key[0]}"] = sorted(set(re.findall(r'name = "(_\w+_kernel)"', text)))
    return out


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import SMALL_QWEN3  # this file runs as a script from tests/

    from prefixscore.model.buckets import Buckets
    from prefixscore.model.engine import CompileCounter, ScoringEngine
    from prefixscore.model.weights import random_params

    assert jax.device_count() == DEVICES, jax.devices()
    cfg = SMALL_QWEN3
    # the 1024 bucket prefills in two 512-token chunks, each split into 8 slices of 64
    buckets = Buckets(prefix=(128, 1024), item=(16, 128), batch=(1, 64), max_batch_tokens=256, prefill_chunk=512)
    params = random_params(cfg, 0, jnp.float32)
    many = ScoringEngine(cfg, params, "float32", buckets, devices=DEVICES)
    one = ScoringEngine(cfg, params, "float32", buckets, devices=1)
    assert many.n_devices == DEVICES and one.n_devices == 1
    many.warmup()
    rng = np.random.default_rng(0)
    labels = [3, 17, 400]
    query = rng.integers(0, cfg.vocab_size, 300).tolist()
    # items of one length: both engines cut identical streams, so every shape matches
    same = [rng.integers(0, cfg.vocab_size, 20).tolist() for _ in range(150)]
    mixed = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 120, 90)]
    diffs = {}
    kv_diff = 0.0
    long_query = rng.integers(0, cfg.vocab_size, 1000).tolist()
    for n in (100, 700, 1000):  # replicated (128 bucket); split, over one and two chunks (1024 bucket)
        a, b = many.prefill(long_query[:n]), one.prefill(long_query[:n])
        valid = slice(0, a.length)
        kv_diff = max(kv_diff, float(np.abs(np.asarray(a.keys)[:, valid] - np.asarray(b.keys)[:, valid]).max()))
        kv_diff = max(kv_diff, float(np.abs(np.asarray(a.values)[:, valid] - np.asarray(b.values)[:, valid]).max()))
    before, one_compiled = CompileCounter.count(), len(one._slots)
    for name, items in (("uniform", same), ("mixed", mixed)):
        for softmax in (False, True):
            a = many.score_items(many.prefill(query), items, labels, softmax)
            b = one.score_items(one.prefill(query), items, labels, softmax)
            diffs[f"{name}/softmax={softmax}"] = float(np.abs(a - b).max())
    sequences = [it + query[:50] for it in mixed[:20]]
    a, b = many.score_sequences(sequences, labels, True), one.score_sequences(sequences, labels, True)
    diffs["item_first"] = float(np.abs(a - b).max())
    steady = CompileCounter.count() - before
    lowered = lower_for_accelerators(cfg)
    spanning = sum(1 for p in many.plan([len(it) for it in same]) if p.tokens > buckets.tokens[-1])
    print(
        json.dumps(
            {
                "devices": many.n_devices,
                "max_abs_diff": diffs,
                "calls_spanning_devices": spanning,
                "prefill_split": {str(p): many._prefill_split(buckets.chunk(p)) for p in buckets.prefix},
                "prefill_kv_max_abs_diff": kv_diff,
                "lowered_kernels": lowered,
                # the 1-device engine compiles on first use
                "steady_state_compilations": steady - (len(one._slots) - one_compiled),
            }
        )
    )


if __name__ == "__main__":
    main()
