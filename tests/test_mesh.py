"""One model across several devices: a 2-D (data, model) mesh on 8 simulated CPU devices.

Tensor parallel on the model axis (heads, MLP columns, vocabulary rows and the pool's KV
heads split; KV heads replicated when the axis exceeds them), data parallel on the other.
Every mesh scores like one device: the same requests laid out in other calls, partial sums
added across devices, so scores agree to float32 rounding (1e-5), not bit for bit.

`--xla_force_host_platform_device_count` must be set before jax starts, so the parts run in
one subprocess, this file as a script (the module's `parts` fixture), and each test reads its part.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import xla_flags

DEVICES = 8
MESHES = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (8, 1)]  # (dp, tp)
# the head split depends on the model axis alone (the data axis replicates it): every model
# axis, and one data axis beside one
HEAD_MESHES = [(1, 2), (1, 4), (1, 8), (2, 4)]  # (data, model)
HEAD_SHAPES = [(16, 1), (16, 2), (16, 4), (16, 8), (8, 8)]  # (query heads, KV heads)
# every head layout on every such mesh: model axes that divide the KV heads, equal them and
# exceed them (replicating them), no grouping (8 under 8), and a data axis beside a model one
HEAD_CASES = [(q, kv, mesh) for q, kv in HEAD_SHAPES for mesh in HEAD_MESHES]
TPU_KERNELS = {"_prefix_kernel", "_ragged_kernel", "_merge_kernel"}
GPU_KERNELS = {"_prefix_kernel", "_ragged_kernel"}
# against transformers' float32 (absolute, on probabilities and log-probs)
TOLERANCE = 1e-5
# a mesh against one device, in log space (helpers/compare.py): probabilities near 2e-3, where an
# absolute 1e-5 let the whole 300-token query be replaced (1e-4 absolute). Measured: 9.8e-7 at most
# on the 8x1, 2x2 and 1x4 meshes (the head splits and interpreted kernels within 1e-5 too); the
# query replaced moves them by 7.4e-2
LOG_TOLERANCE = 1e-5
# (data, model): the needles' mesh, a model axis whose partial sums are added across devices
NEEDLE_MESH = (1, 2)


@pytest.fixture(scope="module")
def parts() -> dict:
    """Every part's result, from ONE subprocess (one jax start, one in-process compile cache for
    the engines the parts share); a part that raised holds its traceback under "error"."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(DEVICES), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


def run_part(parts: dict, part: str) -> dict:
    result = parts[part]
    assert "error" not in result, result.get("error")
    return result


def test_meshes_serve_like_one_device(parts) -> None:
    """Mixed calls with chunked prefills, the prefix cache, label softmax or not, item_first,
    isolation and steady state, on a data-only (8x1), a 2x2 and a model-only (1x4) mesh, each
    request's scores bit for bit the same alone, mixed and from the cache on its mesh; a
    restart on a mesh compiles nothing (the persistent cache). Each mesh is warmed up on the
    shapes its calls take (warm-up's first stage: items alone and beside a prefill region), the
    shapes steady state and the restart are counted over."""
    result = dict(run_part(parts, "engine"))
    assert result.pop("query_replaced") > 100 * LOG_TOLERANCE  # the tolerance sees a wrong query
    assert set(result) == {"8x1", "2x2", "1x4"} and "restart_compilations" in result["2x2"]
    for mesh, r in result.items():
        for case, diff in r["max_log_gap"].items():
            assert diff <= LOG_TOLERANCE, (mesh, case, diff)
        assert r["cached_round_prefill_tokens"] == 0 and r["cached_round_max_diff"] <= LOG_TOLERANCE, (mesh, r)
        assert r["alone_vs_mixed_max_diff"] <= LOG_TOLERANCE, (mesh, r)  # isolation: neighbours change nothing
        assert r["alone_cached_mixed_bit_equal"], (mesh, r)  # and on one mesh, not a bit
        assert r["steady_state_compilations"] == 0, (mesh, r)
        dp = int(mesh.split("x")[0])
        assert r["max_chunks_in_a_call"] >= 2, (mesh, r)
        assert r.get("restart_compilations", 0) == 0, (mesh, r)  # chunks of a query in one call, in order
        # the prefill divided: a call's chunks on as many replicas as it has chunks, up to all
        assert r["max_prefill_replicas"] == min(dp, r["max_chunks_in_a_call"]), (mesh, r)
        assert r["max_replicas_in_a_call"] == dp, (mesh, r)  # the item region really split


def test_head_splits_score_like_one_device(parts) -> None:
    """GQA at any split: KV heads 1, 2, 4, 8 under 16 query heads, and 8 under 8 (no grouping),
    on model axes that divide the KV heads, equal them and exceed them (replicating them),
    against one device."""
    result = run_part(parts, "heads")
    assert len(result) == len(HEAD_CASES)  # every case ran
    for case, diff in result.items():
        assert diff <= LOG_TOLERANCE, (case, diff)


def test_collectives_and_bytes_per_device(parts) -> None:
    """The compiled HLO holds exactly the collectives of the design (model/shards.py): per layer
    two all-reduces of the token stream's hidden states on the model axis (o and down
    projections), one for the embedding, the label rows and the vocabulary log-sum-exp's
    max and sum over a head step's rows, and the probabilities gathered on the data axis; none gathers a weight
    or the pool. Each device holds 1/tp of every split weight and of the pool."""
    result = run_part(parts, "collectives")
    for mesh, r in result.items():
        dp, tp = (int(x) for x in re.findall(r"\d+", mesh))
        t, hidden, rows, labels = r["tokens"], r["hidden"], r["rows"], r["labels"]
        model, data = "model", "data"
        # with several replicas each runs its own prefill chunks: per layer their K and V are
        # gathered for the pool write, and once a call the pages and slots they go to
        prefill, kv, hd = dp * r["prefill_tokens"], r["kv_heads_per_device"], r["head_dim"]
        split_prefill = [["pool_write", "all-gather", data, [prefill, kv, hd]]] * 2 if dp > 1 else []
        split_prefill += [["pool_write", "all-gather", data, [prefill]]] * 2 if dp > 1 else []
        want = sorted(
            split_prefill
            + [
                ["attention", "all-reduce", model, [1, t, hidden]],
                ["mlp", "all-reduce", model, [1, t, hidden]],
                ["embed", "all-reduce", model, [1, t, hidden]],
                ["head", "all-reduce", model, [labels, hidden]],
                ["head", "all-reduce", model, [r["head_step_rows"]]],  # log-sum-exp: max ...
                ["head", "all-reduce", model, [r["head_step_rows"]]],  # ... and sum (per head step)
            ]
            # the probabilities of every replica (none to gather from one)
            + ([["gather", "all-gather", data, [dp * rows, labels]]] if dp > 1 else [])
        )
        assert sorted(r["collectives"]) == want, (mesh, r["collectives"])
        # per layer: the o and down projections (and the prefill K/V with several replicas)
        assert r["layer_loop_collectives"] == (4 if dp > 1 else 2), mesh
        assert r["bytes_per_token_per_layer"] == 2 * hidden * 4, mesh  # two float32 hidden states
        assert all(ratio > 0 for ratio in r["predicted"].values()), mesh
        assert f"mesh tp={tp} dp={dp}" in r["printed"] and f"{2 * hidden * 4} B per token per layer" in r["printed"]
        assert r["split_weight_bytes_per_device"] * tp == r["split_weight_bytes"], mesh
        assert set(r["replicated_weights"]) == set(r["expected_replicated"]), mesh
        assert r["pool_bytes_per_device"] * tp == r["pool_bytes"], mesh
        assert r["engine_pool_bytes"] == r["pool_bytes_per_device"], mesh  # what the engine reports


def test_kernels_under_meshes(parts) -> None:
    """The Pallas TPU and GPU kernels lower for "tpu" and "cuda" inside the sharded call on
    (2,2), (1,4) and (8,1) meshes at production head shapes (16 query heads; 8 KV heads, and 2,
    replicated under tp=4), and run in interpret mode like one device: the TPU kernels under
    (2,2), the GPU kernels under (1,4)."""
    result = run_part(parts, "kernels")
    assert {name.split("/")[0] for name in result["lowered"]} == {"tpu", "cuda"}
    assert len(result["lowered"]) >= 8
    for name, kernels in result["lowered"].items():
        want = TPU_KERNELS if name.startswith("tpu/") else GPU_KERNELS
        assert want <= set(kernels), (name, kernels)
    assert set(result["interpret"]) == {"pallas_tpu/2x2", "pallas_gpu/1x4"}
    for name, diff in result["interpret"].items():
        assert diff <= LOG_TOLERANCE, (name, diff)


def test_checkpoints_load_onto_their_shards_and_score_like_transformers(parts) -> None:
    """A safetensors checkpoint (Llama with q/k/v/o biases, 2 KV heads under tp=4: replicated),
    a GGUF file (Qwen2) and a Gemma 3 checkpoint (sliding windows, soft caps) load straight onto
    a mesh: every weight through the layout's placement, each device holding only its slice;
    the mesh's scores, and its items' own token log-probs and top log-probs, equal transformers'."""
    result = run_part(parts, "load")
    for name, r in result.items():
        assert r["placed"] == r["weights"], name  # every weight went to its shards as it was read
        assert r["split_shard_fraction"] == 1 / r["tp"], name
        assert r["max_abs_diff_vs_transformers"] <= TOLERANCE, (name, r)
        # every item token's log-prob and the top log-probs, the vocabulary split on the model axis
        assert r["likelihood_max_abs_diff_vs_transformers"] <= TOLERANCE, (name, r)
        assert r["likelihood_top_ids_equal"], (name, r)


def test_a_failing_request_sharing_its_query_fails_alone_on_a_mesh(parts) -> None:
    """On a 2x2 mesh: a culprit and three co-riders over one query new to the pool, several items
    each, in one call with its prefill; every call carrying the culprit's work fails (at launch,
    or when read back after consuming the pool). The culprit alone fails, each co-rider gets the
    scores of one device without the fault (log space), and the loop keeps serving."""
    result = run_part(parts, "isolation")
    for where, r in result.items():
        assert r["first_call_riders"] == 4, (where, r)  # they did ride in one call
        assert r["errors"] == ["RuntimeError", None, None, None], (where, r)
        assert r["max_log_diff"] <= TOLERANCE, (where, r)
        assert r["after_ok"], (where, r)


def test_every_kind_gives_the_same_bits_whatever_rides_beside_it_on_a_mesh(parts) -> None:
    """The needle tests of tests/test_invariance.py (score, likelihood, classify, embeddings: alone
    cold and warm, among other items and beside other queries) on a 2-device model axis: the same
    mesh gives a request the same bits whatever its call holds (docs/design.md)."""
    result = run_part(parts, "needles")
    assert result == dict.fromkeys(("score", "likelihood", "classify", "embeddings"), "same bits"), result


@pytest.mark.parametrize(("tp", "dp"), [(3, None), (16, None), (2, 8)])
def test_a_mesh_the_model_or_devices_cannot_take_is_refused_naming_valid_sizes(tp, dp) -> None:
    from conftest import SMALL_QWEN3

    from prefixscore.engine.runtime.mesh import MeshError, choose_mesh

    with pytest.raises(MeshError, match=r"tp-size|dp-size") as err:
        choose_mesh(SMALL_QWEN3, 8, tp, dp)
    if tp in (3, 16):
        assert "valid tp-sizes on 8 device(s): [1, 2, 4]" in str(err.value)


def test_the_default_mesh_is_the_smallest_model_axis_the_weights_fit() -> None:
    from conftest import SMALL_QWEN3

    from prefixscore.engine.runtime.mesh import MeshShape, choose_mesh

    gib = 1 << 30
    assert choose_mesh(SMALL_QWEN3, 8) == MeshShape(8, 1)  # no memory figure (CPU): data parallel
    # 16 GiB of weights on 16 GiB devices (an 8B model in bfloat16 on v5e): tp=2 leaves 50% for the pool
    assert choose_mesh(SMALL_QWEN3, 8, weight_bytes=16 * gib, device_bytes=16 * gib) == MeshShape(4, 2)
    assert choose_mesh(SMALL_QWEN3, 8, weight_bytes=30 * gib, device_bytes=16 * gib) == MeshShape(2, 4)
    assert choose_mesh(SMALL_QWEN3, 8, dp=2) == MeshShape(2, 4)


# ---- the parts, run in a subprocess with 8 devices --------------------------------------------------


def _model(**overrides):
    import dataclasses

    from conftest import SMALL_QWEN3

    # biases on every projection, an untied head, and a vocabulary no model axis divides (padded)
    base = dict(num_heads=8, num_kv_heads=2, vocab_size=509, qkv_bias=True, out_bias=True, tie_word_embeddings=False)
    return dataclasses.replace(SMALL_QWEN3, **{**base, **overrides})


def _requests(cfg, rng, query_tokens=(300, 700, 40)):
    from prefixscore.engine.loop.request import TokenizedRequest
    from prefixscore.engine.requests.answers import label_scores

    labels = (3, 17, cfg.vocab_size - 1)  # the last real row: next to the padding
    tokens = lambda n: rng.integers(0, cfg.vocab_size, int(n)).tolist()  # noqa: E731
    query, long_query, short_query = (tuple(tokens(n)) for n in query_tokens)
    same = [tokens(20) for _ in range(60)]
    mixed = [tokens(n) for n in rng.integers(1, 120, 60)]
    return {
        "uniform/softmax=False": TokenizedRequest(query, same, labels, label_scores(False), False),
        "uniform/softmax=True": TokenizedRequest(query, same[:30], labels[:2], label_scores(True), False),
        "long_query/softmax=False": TokenizedRequest(long_query, mixed, labels, label_scores(False), False),
        "short_query/softmax=True": TokenizedRequest(short_query, mixed[30:50], (9, 400), label_scores(True), False),
        "item_first": TokenizedRequest(
            (), [it + list(query[:50]) for it in mixed[:20]], labels, label_scores(True), True
        ),
    }


def _diff(a, b) -> float:
    """The largest gap of matching probabilities in log space (helpers/compare.py)."""
    from helpers.compare import log_gap

    return max(log_gap(x, y) for x, y in zip(a, b, strict=True))


# ---- what the parts share: one run's engines over one model, built once -------------------------
# The engine and isolation parts read the same model (_model(), seed 0) in the same buckets:
# 128-token prefill chunks, up to 4 in a call's prefill region, 256-token item regions. One
# one-device engine is both parts' reference, and each mesh's engine is built and warmed up once,
# whichever part asks first; a part that drives it through a worker of its own leaves it serving.
# (The collectives part builds its own: its expected collectives are those of its own buckets.)
_SHARED: dict = {}


def _shared(key, make):
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


def _engine_model():
    """(cfg, buckets, params) of the engine, collectives and isolation parts."""

    def make():
        import jax.numpy as jnp

        from prefixscore.engine.runtime.buckets import Buckets
        from prefixscore.model.weights import random_params

        cfg = _model()
        buckets = Buckets(context=1024, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=512)
        return cfg, buckets, random_params(cfg, 0, jnp.float32)

    return _shared("model", make)


def _reference():
    """The one-device EngineRunner of _engine_model(): what every mesh must score like."""

    def make():
        from prefixscore.engine.runtime.scoring_engine import ScoringEngine
        from prefixscore.engine.scorer import EngineRunner

        cfg, buckets, params = _engine_model()
        return EngineRunner(ScoringEngine(cfg, params, "float32", buckets, devices=1))

    return _shared("reference", make)


def _warm(engine) -> dict:
    """Warm-up's first stage: the smallest item bucket, without and with the smallest prefill
    region that holds a chunk; the parts' calls take no other shape (the engine then plans in
    those buckets alone, as it serves during a staged warm-up), so no other shape is compiled."""
    return engine.compile_stages(engine.warmup_stages()[:1])


def _mesh_engine(dp: int, tp: int):
    """The (dp, tp) mesh's engine of _engine_model(), warmed up (_warm)."""

    def make():
        from prefixscore.engine.runtime.mesh import MeshShape
        from prefixscore.engine.runtime.scoring_engine import ScoringEngine

        cfg, buckets, params = _engine_model()
        engine = ScoringEngine(cfg, params, "float32", buckets, mesh=MeshShape(dp, tp))
        _warm(engine)
        return engine

    return _shared(("mesh", dp, tp), make)


def part_engine() -> dict:
    import dataclasses

    import numpy as np

    from prefixscore.engine.runtime.mesh import MeshShape
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.engine.scorer import EngineRunner
    from prefixscore.telemetry.compiles import CompileCounter

    cfg, buckets, params = _engine_model()
    cases = _requests(cfg, np.random.default_rng(0))
    one, _ = _reference().score_requests(list(cases.values()))
    # what LOG_TOLERANCE must see: the first case's items over another 300-token query
    first = next(iter(cases.values()))
    other = dataclasses.replace(first, prefix=tuple(np.random.default_rng(9).integers(0, cfg.vocab_size, 300).tolist()))
    out = {"query_replaced": _diff(_reference().score_requests([other])[0], one[:1])}
    for dp, tp in [(8, 1), (2, 2), (1, 4)]:
        engine = _mesh_engine(dp, tp)
        plans, launch = [], engine.launch
        engine.launch = lambda plan, launch=launch, plans=plans: plans.append(plan) or launch(plan)
        runner = EngineRunner(engine)
        before = CompileCounter.obtained()
        mixed, _ = runner.score_requests(list(cases.values()))
        prefilled = engine.stats["prefill_tokens"]
        cached, _ = runner.score_requests(list(cases.values()))  # every query in the pool now
        alone = [runner.score_requests([request])[0][0] for request in cases.values()]
        replicas = [int((np.asarray(p.inputs.items.n_rows) > 0).sum()) for p in plans]
        out[f"{dp}x{tp}"] = {
            "max_log_gap": {name: _diff([x], [y]) for name, x, y in zip(cases, mixed, one, strict=True)},
            "cached_round_prefill_tokens": engine.stats["prefill_tokens"] - prefilled,
            "cached_round_max_diff": _diff(cached, one),
            "alone_vs_mixed_max_diff": _diff(alone, mixed),
            # the same mesh: the same bits whatever rides beside (docs/design.md)
            "alone_cached_mixed_bit_equal": all(
                np.array_equal(a, m) and np.array_equal(c, m) for a, c, m in zip(alone, cached, mixed, strict=True)
            ),
            "steady_state_compilations": CompileCounter.obtained() - before,
            "max_replicas_in_a_call": max(replicas),
            "max_chunks_in_a_call": max(p.chunks for p in plans),
            "max_prefill_replicas": max(
                int((np.asarray(p.inputs.prefill.write_pages) < engine.pool_pages).any(axis=1).sum()) for p in plans
            ),
        }
        engine.launch = launch
        runner.close()  # the engine stays, for the parts after this one
    # a restart on a mesh compiles nothing: its executables come from the persistent cache
    again = ScoringEngine(cfg, params, "float32", buckets, mesh=MeshShape(2, 2))
    out["2x2"]["restart_compilations"] = _warm(again)["compilations"]
    return out


def part_heads() -> dict:
    import jax.numpy as jnp
    import numpy as np

    from prefixscore.engine.loop.request import TokenizedRequest
    from prefixscore.engine.requests.answers import label_scores
    from prefixscore.engine.runtime.buckets import Buckets
    from prefixscore.engine.runtime.mesh import MeshShape
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.engine.scorer import EngineRunner
    from prefixscore.model.weights import random_params

    # two call shapes (items alone, and beside one prefill region): each engine compiles little
    buckets = Buckets(
        context=256,
        tokens=(64,),
        prefill=(0, 128),
        labels=(4,),
        max_batch_tokens=64,
        prefill_chunk=64,
        max_prefill_tokens=128,
        page_tokens=32,
        segments=8,
    )
    rng = np.random.default_rng(1)
    combos = HEAD_CASES
    out, calls = {}, 0
    for q, kv in sorted({(q, kv) for q, kv, _ in combos}):
        cfg = _model(num_layers=1, num_heads=q, num_kv_heads=kv, hidden_size=32, intermediate_size=64, head_dim=8)
        params = random_params(cfg, 0, jnp.float32)
        tokens = lambda n, cfg=cfg: rng.integers(0, cfg.vocab_size, int(n)).tolist()  # noqa: E731
        # both queries' prefill and every item in one call: one call shape compiled per engine
        first = [tokens(n) for n in rng.integers(1, 8, 5)]
        second = [tokens(n) for n in rng.integers(1, 8, 3)]
        requests = [
            TokenizedRequest(tuple(tokens(90)), first, (3, 17, cfg.vocab_size - 1), label_scores(False), False),
            TokenizedRequest(tuple(tokens(20)), second, (3, 17), label_scores(True), False),
        ]
        # the reference attention (the kernels' oracle) compiles in a third of the time; the
        # kernels run under meshes in part_kernels
        one, _ = EngineRunner(ScoringEngine(cfg, params, "float32", buckets, "reference", devices=1)).score_requests(
            requests
        )
        for dp, tp in (mesh for qq, kk, mesh in combos if (qq, kk) == (q, kv)):
            engine = ScoringEngine(cfg, params, "float32", buckets, "reference", mesh=MeshShape(dp, tp))
            scores, _ = EngineRunner(engine).score_requests(requests)
            out[f"q{q}/kv{kv}/dp{dp}xtp{tp}"] = _diff(scores, one)
            calls += engine.stats["calls"]
    assert calls == len(out), f"{calls} calls for {len(out)} engines: more than one call shape compiled each"
    return out


def part_collectives() -> dict:
    import jax
    import jax.numpy as jnp

    from prefixscore.bench.collectives import format_traffic, traffic
    from prefixscore.engine.runtime.buckets import Buckets
    from prefixscore.engine.runtime.mesh import MeshShape
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.model.weights import flat_weights, random_params

    cfg = _model()
    buckets = Buckets(
        context=256, tokens=(64,), prefill=(0, 128), labels=(4,), max_batch_tokens=64,
        prefill_chunk=64, max_prefill_tokens=128, page_tokens=32, segments=8,
    )  # fmt: skip
    out = {}
    for dp, tp in [(2, 2), (1, 4)]:
        engine = ScoringEngine(cfg, random_params(cfg, 0, jnp.float32), "float32", buckets, mesh=MeshShape(dp, tp))
        shape = max(buckets.call_shapes())  # the call with a prefill region
        report = traffic(engine, shape)
        found = report["collectives"]
        printed = format_traffic(report)  # what `prefixscore bench --collectives` prints
        split = {
            n: a for n, a in flat_weights(engine.params).items() if "model" in engine.layout.weight_spec(n, a.shape)
        }
        replicated = [n for n in flat_weights(engine.params) if n not in split]
        pools = engine._pool  # keys and values
        out[f"dp{dp}xtp{tp}"] = {
            "collectives": [[c["scope"], c["kind"], c["axis"], list(c["shape"])] for c in found],
            "layer_loop_collectives": sum(c["per_layer"] for c in found),
            "bytes_per_token_per_layer": report["bytes_per_token_per_layer"],
            "predicted": report["predicted_allreduce_over_matmul"],
            "printed": printed,
            "tokens": shape.prefill_tokens + shape.item_tokens,
            "prefill_tokens": shape.prefill_tokens,
            "kv_heads_per_device": engine.layout.local_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden": cfg.hidden_size,
            "rows": shape.rows,
            "head_step_rows": buckets.head_rows,
            "labels": shape.labels,
            "split_weight_bytes": sum(a.nbytes for a in split.values()),
            "split_weight_bytes_per_device": sum(a.addressable_shards[0].data.nbytes for a in split.values()),
            "replicated_weights": replicated,
            "expected_replicated": [
                "final_norm",
                "layers.attn_norm",
                "layers.mlp_norm",
                "layers.attn.bo",
                "layers.attn.q_norm",
                "layers.attn.k_norm",
            ],  # fmt: skip
            "pool_bytes": sum(p.nbytes for p in pools),
            "pool_bytes_per_device": sum(p.addressable_shards[0].data.nbytes for p in pools),
            "engine_pool_bytes": engine.pool_bytes,
        }
        assert jax.device_count() == 8
    return out


def part_kernels() -> dict:
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from prefixscore.engine.runtime.buckets import Buckets
    from prefixscore.engine.runtime.mesh import MeshShape
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.engine.scorer import EngineRunner
    from prefixscore.model.weights import random_params

    buckets = Buckets(context=1024, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=512)
    lowered = {}
    for kv, meshes in ((8, [(2, 2), (8, 1)]), (2, [(1, 4)])):
        # the production attention shapes (Qwen3-0.6B: 16 query heads, head_dim 128), one layer
        shaped = _model(
            hidden_size=256, num_heads=16, num_kv_heads=kv, head_dim=128, num_layers=1, intermediate_size=256
        )
        params = random_params(shaped, 0, jnp.bfloat16)
        for impl, platform in (("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")):
            for dp, tp in meshes:
                engine = ScoringEngine(shaped, params, "bfloat16", buckets, attn_impl=impl, mesh=MeshShape(dp, tp))
                for key in (min(engine.executable_keys()), max(engine.executable_keys())):
                    text = engine.lower_for(key, platform).as_text()
                    name = f"{platform}/kv{kv}/dp{dp}xtp{tp}/prefill={key.prefill_tokens}/items={key.item_tokens}"
                    lowered[name] = sorted(set(re.findall(r'name = "(_\w+_kernel)"', text)))
    # interpret mode: what the kernels compute, on a mesh, against one device's XLA path
    cfg = _model(num_layers=1)
    small = dataclasses.replace(buckets, context=512, max_prefill_tokens=256)
    params = random_params(cfg, 0, jnp.float32)
    requests = list(_requests(cfg, np.random.default_rng(2), (200, 150, 30)).values())[:2]
    one, _ = EngineRunner(ScoringEngine(cfg, params, "float32", small, attn_impl="xla", devices=1)).score_requests(
        requests
    )
    interpret = {}
    for impl, (dp, tp) in (("pallas_tpu", (2, 2)), ("pallas_gpu", (1, 4))):  # both axes, between them
        engine = ScoringEngine(cfg, params, "float32", small, attn_impl=impl, mesh=MeshShape(dp, tp))
        interpret[f"{impl}/{dp}x{tp}"] = _diff(EngineRunner(engine).score_requests(requests)[0], one)
    return {"lowered": lowered, "interpret": interpret}


def part_load() -> dict:
    import tempfile
    from pathlib import Path

    import jax
    import numpy as np
    import torch
    from conftest import make_torch_model, torch_label_probs
    from gguf import GGMLQuantizationType as Q
    from helpers.gguf_files import write_gguf

    from prefixscore.engine.loop.request import TokenizedRequest
    from prefixscore.engine.requests.answers import label_scores
    from prefixscore.engine.requests.likelihood import layout, read_likelihoods
    from prefixscore.engine.requests.validation import RequestTokenizer
    from prefixscore.engine.runtime.buckets import Buckets
    from prefixscore.engine.runtime.mesh import Layout, MeshShape
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.engine.runtime.token_rows import TokenRows
    from prefixscore.engine.scorer import EngineRunner
    from prefixscore.model.call_inputs import TOP_LOGPROBS
    from prefixscore.model.loader import load_model
    from prefixscore.model.weights import flat_weights

    # the query's two chunks and every item in one call: one executable compiled per checkpoint
    buckets = Buckets(context=512, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=256)
    rng = np.random.default_rng(3)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "safetensors/llama": ("llama", dict(attention_bias=True), (1, 4)),
            "gguf/qwen2": ("qwen2", dict(vocab_size=321), (2, 2)),  # an odd vocabulary: padded for tp=2
            # windows past a 48-token window, soft caps over a split vocabulary, post-norms, q/k norms
            "safetensors/gemma3": ("gemma3_text", {}, (2, 2)),
        }
        for name, (family, overrides, (dp, tp)) in cases.items():
            torch_model = make_torch_model(family, seed=5, **overrides)
            if name.startswith("gguf"):
                path = Path(tmp) / f"{family}.gguf"
                write_gguf(torch_model, family, path, Q.F32)
            else:
                path = Path(tmp) / family
                torch_model.save_pretrained(path)
            placed, layouts = [], []

            def place_for(cfg, dp=dp, tp=tp, placed=placed, layouts=layouts):
                layouts.append(Layout(cfg, MeshShape(dp, tp), jax.devices()))

                def place(weight, array, layout=layouts[-1]):
                    placed.append(weight)
                    return layout.place(weight, array)

                return place

            loaded = load_model(str(path), "float32", place_for)
            weights = flat_weights(loaded.params)
            split = [a for n, a in weights.items() if "model" in layouts[-1].weight_spec(n, a.shape)]
            engine = ScoringEngine(loaded.cfg, loaded.params, "float32", buckets, mesh=layouts[-1])
            vocab = loaded.cfg.vocab_size
            query = rng.integers(0, vocab, 150).tolist()
            items = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 30, 12)]
            labels = (3, 17, vocab - 1)
            # the items' label scores, and their own likelihood (the head at every item token, over
            # the split vocabulary), queued together: the likelihood's prefix is the query but its last
            # token, which starts each of its items, so the score request is laid out the same way
            likelihood = layout(RequestTokenizer(loaded.cfg, None), query, TokenRows.from_lists(items))
            score = TokenizedRequest(
                likelihood.prefix, [query[-1:] + item for item in items], labels, label_scores(False), False
            )
            runner = EngineRunner(engine)
            scored, likelihood_unit = runner.run_requests([score, likelihood])
            runner.close()
            scores = [scored.reply.answer]
            want = torch_label_probs(torch_model, [query + item for item in items], labels, False)
            got = read_likelihoods(likelihood, likelihood_unit.reply.answer)
            ll_diff, top_equal = 0.0, True
            for item, g in zip(items, got, strict=True):
                with torch.no_grad():
                    lp = torch.log_softmax(torch_model(torch.tensor([query + item])).logits[0].double(), -1).numpy()
                at = lp[len(query) - 1 : -1]
                ll_diff = max(ll_diff, float(np.abs(g.logprobs - at[np.arange(len(item)), item]).max()))
                ll_diff = max(ll_diff, float(np.abs(g.top_logprobs - -np.sort(-at, axis=1)[:, :TOP_LOGPROBS]).max()))
                top_equal &= bool((g.top_ids == np.argsort(-at, axis=1, kind="stable")[:, :TOP_LOGPROBS]).all())
            out[name] = {
                "tp": tp,
                "weights": sorted(weights),
                "placed": sorted(placed),
                "split_shard_fraction": min(a.addressable_shards[0].data.size / a.size for a in split),
                "max_abs_diff_vs_transformers": float(np.abs(scores[0] - want).max()),
                "likelihood_max_abs_diff_vs_transformers": ll_diff,
                "likelihood_top_ids_equal": top_equal,
            }
    return out


class _FailedReadBack:
    """What a call that fails on the device returns: reading it raises (np.asarray)."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("injected fault: the call failed on the device")


def part_isolation() -> dict:
    import threading

    import numpy as np

    from prefixscore.engine.loop.device_loop import DeviceWorker
    from prefixscore.engine.loop.request import TokenizedRequest
    from prefixscore.engine.loop.work_unit import Ticket, WorkUnit
    from prefixscore.engine.requests.answers import label_scores
    from prefixscore.telemetry.metrics import ServiceMetrics

    cfg, _, _ = _engine_model()
    rng = np.random.default_rng(4)
    label_sets = [(5, 9), (3, 17), (17, 3, 400), (44, 45)]  # the culprit's first
    out = {}
    for where in ("launch", "read-back"):
        query = tuple(rng.integers(0, cfg.vocab_size, 60).tolist())
        requests = [
            TokenizedRequest(query, [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 9, 4)],
                             labels, label_scores(False), False)
            for labels in label_sets
        ]  # fmt: skip
        one, _ = _reference().score_requests(requests[1:])
        # the engine part's 2x2 engine (a query new to its pool), driven by this worker alone
        engine = _mesh_engine(2, 2)
        launch, riders = engine.launch, []

        def faulty(plan, launch=launch, riders=riders, where=where, engine=engine):
            labels = {span.ref.payload.label_ids for span in plan.spans}
            riders.append(len(labels))
            if label_sets[0] not in labels:
                return launch(plan)
            if where == "launch":
                raise RuntimeError("RESOURCE_EXHAUSTED: injected out of memory")
            launch(plan)
            for part in engine._pool:  # the pool it was handed (donated) is gone with the call
                part.delete()
            return _FailedReadBack()

        engine.launch = faulty
        started = threading.Event()
        ready = lambda err, started=started: started.set()  # noqa: E731
        worker = DeviceWorker(lambda engine=engine: engine, ServiceMetrics(), 1 << 20, ready)
        worker.start()
        started.wait()
        units = [WorkUnit(r, Ticket(method="InProcess")) for r in requests]
        left = threading.Semaphore(0)
        for unit in units:
            unit.reply.on_done = lambda _, left=left: left.release()
        with worker.paused():
            for unit in units:
                worker.submit(unit)
        for _ in units:
            left.acquire()
        after = WorkUnit(
            TokenizedRequest(query, [[1, 2, 3]], (3, 17), label_scores(False), False), Ticket(method="InProcess")
        )
        after.reply.on_done = lambda _, left=left: left.release()
        worker.submit(after)
        left.acquire()
        worker.stop(30.0)
        engine.launch = launch
        got = [np.log(u.reply.answer) for u in units[1:]]
        out[where] = {
            "first_call_riders": riders[0],
            "errors": [type(u.reply.error).__name__ if u.reply.error else None for u in units],
            "max_log_diff": max(float(np.abs(g - np.log(w)).max()) for g, w in zip(got, one, strict=True)),
            "after_ok": after.reply.error is None and worker.failure is None,
        }
    return out


def part_needles() -> dict:
    """tests/test_invariance.py's needles of every kind on a 2-device model axis, in float32: per
    kind "same bits", or the first case that differed."""
    import pathlib
    import tempfile

    from conftest import SMALL_BUCKETS
    from test_invariance import (
        check_classify,
        check_embeddings,
        check_likelihood,
        check_score,
        save_classifier,
        save_embedder,
    )

    from prefixscore import Scorer

    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = pathlib.Path(scratch)

        def on_mesh(model: str) -> Scorer:
            return Scorer.load(model, "float32", buckets=SMALL_BUCKETS, tp_size=NEEDLE_MESH[1], dp_size=NEEDLE_MESH[0])

        lm = on_mesh("tiny-qwen3")
        checks = {
            "score": lambda: [check_score(lm, n) for n in (20, 45)],
            "likelihood": lambda: check_likelihood(lm),
            "classify": lambda: check_classify(on_mesh(save_classifier(tmp / "classifier"))),
            "embeddings": lambda: check_embeddings(on_mesh(save_embedder(tmp / "embedder"))),
        }
        for kind, check in checks.items():
            try:
                check()
                out[kind] = "same bits"
            except AssertionError as err:
                out[kind] = str(err)[:3000]
    return out


def main() -> None:
    import traceback

    import jax

    assert jax.device_count() == DEVICES, jax.devices()
    parts = {
        "engine": part_engine,
        "heads": part_heads,
        "collectives": part_collectives,
        "kernels": part_kernels,
        "load": part_load,
        "isolation": part_isolation,
        "needles": part_needles,
    }
    out = {}
    for name, part in parts.items():
        if sys.argv[1:] and name not in sys.argv[1:]:  # by hand: `python tests/test_mesh.py isolation`
            continue
        try:
            out[name] = part()
        except Exception:  # the other parts still run; the part's test shows why it failed
            out[name] = {"error": traceback.format_exc()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
