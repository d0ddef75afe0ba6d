"""Data parallelism: weights and the prefix pool replicated, the prefill region of a call run on
every device (each replica of the pool gets the same pages written), the item region split
across devices; scores as on one device. On CPU with 8 simulated devices.

The two engines lay the same requests out in different calls (8 item streams a call against
one), and XLA may round a row differently in the last bit depending on what shares its
matmuls, so scores agree to float32 rounding (1e-6), not bit for bit.

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
TPU_KERNELS = {"_prefix_kernel", "_ragged_kernel", "_merge_kernel"}
GPU_KERNELS = {"_prefix_kernel", "_ragged_kernel"}


def test_eight_devices_score_like_one() -> None:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["devices"] == DEVICES
    assert result["calls_spanning_devices"] > 0  # the multi-device engine really split item regions
    assert result["max_devices_in_a_call"] == DEVICES
    # the long query's prefill: several chunks in one call's prefill region, over several calls
    assert result["max_chunks_in_a_call"] >= 2 and result["calls_with_chunks"] >= 2, result
    for case, diff in result["max_abs_diff"].items():
        assert diff <= 1e-6, (case, diff)
    assert result["steady_state_compilations"] == 0
    # every 8-device call shape lowers with the real TPU and GPU kernels too
    assert {call.split("/")[0] for call in result["lowered_kernels"]} == {"tpu", "cuda"}
    for call, names in result["lowered_kernels"].items():
        want = TPU_KERNELS if call.startswith("tpu/") else GPU_KERNELS
        assert want <= set(names), (call, names)


def lower_for_accelerators(cfg, buckets) -> dict[str, list[str]]:
    """Lower every 8-device call shape for a TPU slice and for GPUs (see tests/test_kernels_lowering.py)
    at the production head shapes: the sharded call and the kernels together."""
    import dataclasses
    import re

    import jax.numpy as jnp

    from prefixscore.engine.executables import ScoringEngine
    from prefixscore.model.weights import random_params

    shaped = dataclasses.replace(cfg, hidden_size=256, num_heads=16, num_kv_heads=8, head_dim=128, num_layers=1)
    out = {}
    for impl, platform in (("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")):
        engine = ScoringEngine(shaped, random_params(shaped, 0, jnp.bfloat16), "bfloat16", buckets, attn_impl=impl)
        assert engine.n_devices == DEVICES
        for key in engine.executable_keys():
            text = engine.lower_for(key, platform).as_text()
            name = f"{platform}/prefill={key.prefill_tokens}/items={key.item_tokens}/labels={key.labels}"
            out[name] = sorted(set(re.findall(r'name = "(_\w+_kernel)"', text)))
    return out


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import SMALL_QWEN3  # this file runs as a script from tests/

    from prefixscore.engine.buckets import Buckets
    from prefixscore.engine.executables import CompileCounter, ScoringEngine
    from prefixscore.engine.scorer import EngineRunner
    from prefixscore.engine.validation import TokenizedRequest
    from prefixscore.model.weights import random_params

    assert jax.device_count() == DEVICES, jax.devices()
    cfg = SMALL_QWEN3
    # 128-token prefill chunks, up to 4 in a call's prefill region; 256-token item regions
    buckets = Buckets(context=1024, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=512)
    params = random_params(cfg, 0, jnp.float32)
    many = ScoringEngine(cfg, params, "float32", buckets, devices=DEVICES)
    one = ScoringEngine(cfg, params, "float32", buckets, devices=1)
    assert many.n_devices == DEVICES and one.n_devices == 1
    many.warmup()
    one.warmup()

    plans = []
    launch = many.launch

    def recording_launch(plan):
        plans.append(plan)
        return launch(plan)

    many.launch = recording_launch

    rng = np.random.default_rng(0)
    labels = (3, 17, 400)
    tokens = lambda n: rng.integers(0, cfg.vocab_size, int(n)).tolist()  # noqa: E731
    query, long_query, short_query = tuple(tokens(300)), tuple(tokens(700)), tuple(tokens(40))
    same = [tokens(20) for _ in range(150)]  # one length
    mixed = [tokens(n) for n in rng.integers(1, 120, 90)]
    cases = {
        "uniform/softmax=False": TokenizedRequest(query, same, labels, False, False),
        "uniform/softmax=True": TokenizedRequest(query, same, labels[:2], True, False),
        "long_query/softmax=False": TokenizedRequest(long_query, mixed, labels, False, False),
        "long_query/softmax=True": TokenizedRequest(long_query, mixed[:30], labels, True, False),
        "short_query/softmax=True": TokenizedRequest(short_query, mixed[30:50], (9, 400), True, False),
        "item_first": TokenizedRequest((), [it + list(query[:50]) for it in mixed[:20]], labels, True, True),
    }
    before = CompileCounter.count()
    a, _ = EngineRunner(many).score_requests(list(cases.values()))
    b, _ = EngineRunner(one).score_requests(list(cases.values()))
    diffs = {}
    for name, x, y in zip(cases, a, b, strict=True):
        assert x.shape == y.shape == (len(cases[name].items), len(cases[name].label_ids)), name
        assert np.isfinite(x).all() and (x > 0).any(), name
        diffs[name] = float(np.abs(x - y).max())
    steady = CompileCounter.count() - before
    devices_used = [int((np.asarray(p.inputs.items.n_rows) > 0).sum()) for p in plans]
    lowered = lower_for_accelerators(cfg, buckets)
    print(
        json.dumps(
            {
                "devices": many.n_devices,
                "max_abs_diff": diffs,
                "calls": len(plans),
                "calls_spanning_devices": sum(1 for n in devices_used if n > 1),
                "max_devices_in_a_call": max(devices_used),
                "max_chunks_in_a_call": max(p.chunks for p in plans),
                "calls_with_chunks": sum(1 for p in plans if p.chunks),
                "lowered_kernels": lowered,
                "steady_state_compilations": steady,
            }
        )
    )


if __name__ == "__main__":
    main()
