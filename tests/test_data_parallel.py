"""Data parallelism: weights and prefix KV replicated, item streams split across devices,
scores identical to one device. On CPU with 8 simulated devices.

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
    for case, diff in result["max_abs_diff"].items():
        assert diff == 0.0, (case, diff)
    assert result["steady_state_compilations"] == 0


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from prefixscore.model.buckets import Buckets
    from prefixscore.model.config import ModelConfig
    from prefixscore.model.engine import CompileCounter, ScoringEngine
    from prefixscore.model.weights import random_params

    assert jax.device_count() == DEVICES, jax.devices()
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
    buckets = Buckets(prefix=(128, 512), item=(16, 128), batch=(1, 64), max_batch_tokens=256)
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
    before = CompileCounter.count()
    for name, items in (("uniform", same), ("mixed", mixed)):
        for softmax in (False, True):
            a = many.score_items(many.prefill(query), items, labels, softmax)
            b = one.score_items(one.prefill(query), items, labels, softmax)
            diffs[f"{name}/softmax={softmax}"] = float(np.abs(a - b).max())
    sequences = [it + query[:50] for it in mixed[:20]]
    a, b = many.score_sequences(sequences, labels, True), one.score_sequences(sequences, labels, True)
    diffs["item_first"] = float(np.abs(a - b).max())
    steady = CompileCounter.count() - before
    spanning = sum(1 for p in many.plan([len(it) for it in same]) if p.tokens > buckets.tokens[-1])
    print(
        json.dumps(
            {
                "devices": many.n_devices,
                "max_abs_diff": diffs,
                "calls_spanning_devices": spanning,
                "steady_state_compilations": steady - (len(one._slots)),  # the 1-device engine compiles on first use
            }
        )
    )


if __name__ == "__main__":
    main()
