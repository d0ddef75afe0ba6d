"""The GPU (Triton) and TPU (Mosaic) kernels lowered for their real backends, on this CPU machine.

Interpret mode (tests/test_kernels.py) checks what the kernels compute; it does not run
the Triton or Mosaic lowering, which is where block shapes, layouts and unsupported
operations fail. Here every executable the engine compiles at start-up (every CallShape:
item regions alone and beside a prefill region), at the production model's attention
shapes (Qwen3-0.6B: 16 query heads, 8 kv heads, head_dim 128) and bfloat16, is lowered
for "cuda" and "tpu" exactly as on that hardware (`ScoringEngine.lower_for`), and each
must contain its backend's kernels: a shape that silently fell back to the XLA path
would fail. A 4k context keeps the default bucket list short (every shape kind is there).
What is left for the hardware is the backends' own compilation (ptxas, Mosaic's TPU
compiler) and speed: tests/test_kernels_device.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.kernels import dispatch, selfcheck
from prefixscore.model import presets
from prefixscore.model.call_inputs import TOP_LOGPROBS, CallShape
from prefixscore.model.weights import random_params

# the kernels every device call must contain, by (implementation, platform)
# (Triton merges in an XLA fusion; Mosaic has a merge kernel)
GPU_KERNELS = {"_prefix_kernel", "_ragged_kernel"}
TPU_KERNELS = {"_prefix_kernel", "_ragged_kernel", "_merge_kernel"}
PLATFORMS = {("pallas_gpu", "cuda"): GPU_KERNELS, ("pallas_tpu", "tpu"): TPU_KERNELS}
CONTEXT = 4096
BUCKETS = Buckets.for_context(CONTEXT)  # the engine's defaults for this context


def kernel_names(lowered_text: str) -> set[str]:
    """Pallas kernels in a lowered module (Triton and Mosaic custom calls carry the kernel's name)."""
    return set(re.findall(r'name = "(_\w+_kernel)"', lowered_text))


def production_shaped(preset: str, dtype: str, attn_impl: str, **overrides) -> ScoringEngine:
    """The preset's attention and MLP shapes with 2 layers, a 4k vocabulary and a 4k context:
    kernels see exactly the production shapes; the buckets stay few."""
    cfg = dataclasses.replace(
        presets.RANDOM_PRESETS[preset][0],
        **{"num_layers": 2, "vocab_size": 4096, "max_position_embeddings": CONTEXT, **overrides},
    )
    return ScoringEngine(cfg, random_params(cfg, 0, getattr(jnp, dtype)), dtype, BUCKETS, attn_impl=attn_impl)


def one_of_each_kind(engine: ScoringEngine) -> list[CallShape]:
    """The largest call without a prefill region, and the largest with one."""
    keys = engine.executable_keys()
    size = lambda k: (k.prefill_tokens, k.item_tokens)  # noqa: E731
    return [max((k for k in keys if (k.prefill_tokens > 0) == kind), key=size) for kind in (False, True)]


@pytest.mark.parametrize(("impl", "platform"), list(PLATFORMS))
def test_every_call_shape_lowers_with_the_backend_kernels(impl: str, platform: str):
    engine = production_shaped("qwen3-0.6b-random", "bfloat16", impl)
    keys = engine.executable_keys()
    assert {k.prefill_tokens > 0 for k in keys} == {True, False}  # both kinds of call
    assert {k.item_tokens for k in keys} == set(BUCKETS.tokens)
    assert {k.prefill_tokens for k in keys} == set(BUCKETS.prefill)
    for key in keys:
        found = kernel_names(engine.lower_for(key, platform).as_text())
        missing = PLATFORMS[impl, platform] - found
        assert not missing, f"{impl} {key}: {sorted(missing)} fell back to XLA (found {sorted(found)})"


@pytest.mark.parametrize(("impl", "platform"), list(PLATFORMS))
def test_bench_cpu_shapes_lower_in_float32(impl: str, platform: str):
    # head_dim 64, 4 query heads over 2 kv heads, float32: the other shapes the kernels claim
    engine = production_shaped("bench-cpu", "float32", impl)
    for key in one_of_each_kind(engine):
        found = kernel_names(engine.lower_for(key, platform).as_text())
        assert PLATFORMS[impl, platform] <= found, (impl, key, found)


@pytest.mark.parametrize(("impl", "platform"), list(PLATFORMS))
def test_token_row_calls_lower(impl: str, platform: str):
    """A call with token rows (items' own likelihood: the head at every item token, with its top
    log-probs) lowers with the backend kernels, and for GPUs still has no branch on a runtime value."""
    engine = production_shaped("bench-cpu", "float32", impl)
    smallest = min(k for k in engine.executable_keys() if k.prefill_tokens > 0)
    key = BUCKETS.shape(smallest.prefill_tokens, smallest.item_tokens, smallest.labels, TOP_LOGPROBS)
    assert key.rows == key.prefill_tokens + key.item_tokens  # a row per token: a chunk's own, an item's
    text = engine.lower_for(key, platform).as_text()
    assert PLATFORMS[impl, platform] <= kernel_names(text), (impl, key)
    assert "top_k" in text
    if platform == "cuda":
        assert not re.search(r"stablehlo\.(case|if)\b", text)


@pytest.mark.parametrize(("impl", "platform"), list(PLATFORMS))
def test_windowed_soft_capped_layer_lowers(impl: str, platform: str):
    # the calls above carry a traced window (NO_WINDOW: every layer there attends fully); here a
    # windowed layer with Gemma 2's soft cap and a scale of its own, static, at Qwen3-0.6B's heads
    x = selfcheck.case(16, 8, 128, "bfloat16", window=selfcheck.WINDOW, logits=selfcheck.LOGITS)
    args = [x[n] for n in ("q", "k", "v", "pool_k", "pool_v", "meta")]
    with dispatch.lowering_for(platform):
        lowered = jax.jit(dispatch.get(impl).paged_attention).trace(*args).lower(lowering_platforms=(platform,))
    assert PLATFORMS[impl, platform] <= kernel_names(lowered.as_text())


def test_untileable_head_dim_falls_back_to_xla():
    # head_dim 80 (Phi-style) is no power of two: the GPU kernels must step aside, not miscompile,
    # and the check above must be able to tell
    engine = production_shaped("bench-cpu", "float32", "pallas_gpu", num_layers=1, vocab_size=1024, head_dim=80)
    for key in one_of_each_kind(engine):
        text = engine.lower_for(key, "cuda").as_text()
        assert kernel_names(text) == set(), key
        assert "xla.gpu.triton" not in text, key


def test_lowering_for_sets_the_target_only_inside():
    default = dispatch.target_backend()
    with dispatch.lowering_for("tpu"):
        assert dispatch.target_backend() == "tpu"
        with dispatch.lowering_for("cuda"):
            assert dispatch.target_backend() == "gpu"
        assert dispatch.target_backend() == "tpu"
    assert dispatch.target_backend() == default
    with pytest.raises(ValueError, match="platform 'metal' unknown"):
        with dispatch.lowering_for("metal"):
            pass


def test_gpu_calls_have_no_host_synchronising_control_flow():
    """On GPUs a loop or branch on a runtime value reads its predicate back to the host, which
    blocks the launch until the device gets there: a call for "cuda" has only fixed-trip loops
    (the layer scan, the vocabulary tiles) and no branches. CPU calls keep the row loop of the
    output head (on CPU, rows computed in vain cost real time)."""
    engine = production_shaped("qwen3-0.6b-random", "bfloat16", "pallas_gpu")
    key = max(engine.executable_keys(), key=lambda k: (k.prefill_tokens, k.item_tokens))
    gpu = engine.lower_for(key, "cuda").as_text()
    assert not re.search(r"stablehlo\.(case|if)\b", gpu)
    cpu = production_shaped("qwen3-0.6b-random", "bfloat16", "xla").lower_for(key, "cpu").as_text()
    assert re.search(r"stablehlo\.(case|if)\b", cpu)
    assert gpu.count("stablehlo.while") < cpu.count("stablehlo.while")
