"""GGUF loading: metadata -> config, tensors (F32, F16; Q8_0, Q4_0, Q4_1 kept 8-bit), llama.cpp's q/k permutation; a
file mixing block types as Q4_K_M does (K-quants among them) served end to end; the embedded SmolLM2 served 8-bit
(`--quantize auto`) scores as its dequantized load (`--quantize none`) bit for bit.

Probabilities here are about 3e-3 (a vocabulary of 320): they are compared as log-probabilities."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import ONE_SHAPE_BUCKETS, make_torch_model, torch_label_probs
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize
from helpers.gguf_files import llama_cpp_permute_inverse, write_gguf

from prefixscore import Scorer
from prefixscore.model.config import UnsupportedModelError
from prefixscore.model.quant import QuantizedMatrix


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Converted weights of this module's files go to its own cache, not the user's."""
    monkeypatch.setenv("PREFIXSCORE_CACHE", str(tmp_path / "cache"))


QUERY = list(range(3, 40))
ITEMS = [[7, 8, 9], [100], [250, 251, 252, 253, 254, 255, 256, 257, 258, 259]]
LABELS = [1, 2, 300]
# W8A16 and float weights against transformers on the same (dequantized) weights: float32 rounding
LOG_TOLERANCE = 1e-5
# one item bucket, one prefill bucket: every call here has a query's prefill beside its items, so
# each model compiles one executable
BUCKETS = ONE_SHAPE_BUCKETS


@pytest.mark.parametrize(
    "family,qtype",
    [
        ("llama", Q.Q4_0),
        ("llama", Q.Q4_1),
        ("llama", Q.Q8_0),
        ("qwen2", Q.F16),
        ("qwen3", Q.F32),
        ("qwen3", Q.Q8_0),
        ("gemma", Q.Q8_0),
    ],
)
def test_gguf_matches_dequantized_transformers(tmp_path, family, qtype):
    model = make_torch_model(family, seed=7)
    path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(model, family, path, qtype)
    scorer = Scorer.load(str(path), buckets=BUCKETS)
    assert scorer.cfg.family == family
    assert scorer.model.tokenizer is None  # no tokenizer metadata in this file: token ids still work
    # block formats stay 8-bit on the device (W8A16: model/quant.py), float ones as they were
    assert isinstance(scorer.model.params.layers.mlp.w_up, QuantizedMatrix) == (qtype not in (Q.F16, Q.F32))
    got = np.array(scorer.score(QUERY, ITEMS, LABELS))
    want = torch_label_probs(model, [QUERY + it for it in ITEMS], LABELS, False)
    np.testing.assert_allclose(np.log(got), np.log(want), rtol=0, atol=LOG_TOLERANCE)
    with pytest.raises(ValueError, match="query.*tokenizer"):
        scorer.score("some text", ["an item"], LABELS)


# what llama.cpp fixes for these architectures rather than storing it: queries scaled by the head
# width, Gemma 3's local RoPE base of 10,000 (unscaled) and five sliding layers of six (the sixth
# full, its RoPE scaled as rope.scaling says)
GGUF_GEMMA = {
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    "gemma3": (
        "gemma3_text",
        dict(
            query_pre_attn_scalar=16,
            num_hidden_layers=6,
            layer_types=None,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                # Gemma 3 4B and larger: the full layers' RoPE scaled linearly
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
        ),
    ),
}


@pytest.mark.parametrize("arch", GGUF_GEMMA)
def test_gemma_gguf_scores_as_its_safetensors_twin(tmp_path, arch):
    """A Gemma 2 / Gemma 3 file as llama.cpp writes it (norms stored as 1 + weight, the pre-MLP
    norm as ffn_norm, soft caps and window in metadata) scores as the checkpoint it came from,
    with a query longer than the window."""
    model_type, overrides = GGUF_GEMMA[arch]
    model = make_torch_model(model_type, seed=7, **overrides)
    model.save_pretrained(tmp_path / "hf")
    write_gguf(model, arch, tmp_path / "twin.gguf", Q.F32)
    query = list(range(3, 63))  # 60 tokens: past the 48-token window
    from_gguf = Scorer.load(str(tmp_path / "twin.gguf"), buckets=BUCKETS)
    from_hf = Scorer.load(str(tmp_path / "hf"), buckets=BUCKETS)
    assert dataclasses.replace(from_gguf.cfg, rms_norm_eps=0) == dataclasses.replace(from_hf.cfg, rms_norm_eps=0)
    got = np.log(np.array(from_gguf.score(query, ITEMS, LABELS)))
    np.testing.assert_allclose(got, np.log(np.array(from_hf.score(query, ITEMS, LABELS))), rtol=0, atol=1e-6)
    want = torch_label_probs(model, [query + it for it in ITEMS], LABELS, False)
    np.testing.assert_allclose(got, np.log(want), rtol=0, atol=LOG_TOLERANCE)


# A Q4_K_M-like file: llama.cpp's Q4_K_M keeps most projections Q4_K and some (attn_v, ffn_down) Q6_K, so one
# projection's layers differ in type; every other served block type is here too. Shapes whose every projection
# input is a multiple of 256 (a K-quant super-block).
MIXED_SHAPES = dict(hidden_size=256, intermediate_size=512, head_dim=64)
MIXED_TYPES = {
    0: dict(
        attn_q=Q.Q4_K, attn_k=Q.Q4_K, attn_v=Q.Q6_K, attn_output=Q.Q4_K, ffn_gate=Q.Q4_K, ffn_up=Q.Q4_K, ffn_down=Q.Q6_K
    ),
    1: dict(
        attn_q=Q.Q5_K, attn_k=Q.Q8_0, attn_v=Q.Q4_1, attn_output=Q.Q5_0, ffn_gate=Q.Q5_1, ffn_up=Q.Q4_0, ffn_down=Q.Q4_K
    ),
}
# the served projections and their llama.cpp tensor names (the test's own table)
PROJECTION_NAMES = {
    ("attn", "wq"): "attn_q",
    ("attn", "wk"): "attn_k",
    ("attn", "wv"): "attn_v",
    ("attn", "wo"): "attn_output",
    ("mlp", "w_gate"): "ffn_gate",
    ("mlp", "w_up"): "ffn_up",
    ("mlp", "w_down"): "ffn_down",
}


def _mixed_type(name: str) -> Q:
    parts = name.split(".")
    return MIXED_TYPES[int(parts[1])][parts[2]] if parts[0] == "blk" else Q.F32


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(the file, the transformers model holding its dequantized weights, its Scorer)."""
    root = tmp_path_factory.mktemp("mixed")
    model = make_torch_model("llama", seed=5, **MIXED_SHAPES)
    write_gguf(model, "llama", root / "q4_k_m.gguf", _mixed_type)
    with pytest.MonkeyPatch.context() as mp:  # the converted weights in this module's own cache
        mp.setenv("PREFIXSCORE_CACHE", str(root / "cache"))
        scorer = Scorer.load(str(root / "q4_k_m.gguf"), buckets=BUCKETS)
    return root / "q4_k_m.gguf", model, scorer


def test_a_mixed_k_quant_file_is_served_with_gguf_py_weights_bit_for_bit(mixed):
    """Every projection of every layer, as the served step dequantizes it (W8A16, inside a jitted call), is
    gguf-py's dequantization of the file's tensor bit for bit (llama's q/k rows unpermuted)."""
    import jax
    import jax.numpy as jnp

    from prefixscore.model.quant import dequantize as served_dequantize

    path, model, scorer = mixed
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    cfg = model.config
    for (group, field), gguf_name in PROJECTION_NAMES.items():
        w = getattr(getattr(scorer.model.params.layers, group), field)
        assert isinstance(w, QuantizedMatrix), (group, field)
        served = np.asarray(jax.jit(served_dequantize, static_argnums=1)(w, jnp.float32))
        for layer in MIXED_TYPES:
            t = tensors[f"blk.{layer}.{gguf_name}.weight"]
            assert t.tensor_type == MIXED_TYPES[layer][gguf_name]
            want = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
            if gguf_name in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if gguf_name == "attn_q" else cfg.num_key_value_heads
                want = llama_cpp_permute_inverse(want, heads)
            got = np.ascontiguousarray(served[layer].T)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{gguf_name}[{layer}]")


def test_a_mixed_k_quant_file_scores_as_transformers_on_its_dequantized_weights(mixed):
    _, model, scorer = mixed
    got = np.log(np.array(scorer.score(QUERY, ITEMS, LABELS)))
    want = np.log(torch_label_probs(model, [QUERY + it for it in ITEMS], LABELS, False))
    np.testing.assert_allclose(got, want, rtol=0, atol=LOG_TOLERANCE)


def test_a_gemma_1_file_with_a_window_is_refused(tmp_path):
    """llama.cpp's Gemma 1 graph reads no window: a file carrying one is refused, not slid."""
    path = tmp_path / "gemma.gguf"
    write_gguf(make_torch_model("gemma", seed=7), "gemma", path, Q.F32, {"{arch}.attention.sliding_window": 48})
    with pytest.raises(UnsupportedModelError, match="gemma.attention.sliding_window=48"):
        Scorer.load(str(path), buckets=BUCKETS)


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Scorer.load(str(path))


def test_converted_weights_are_cached_and_follow_their_source(tmp_path, monkeypatch):
    """A GGUF file is converted once; later loads read the cached conversion (the converter is
    not called) with identical weights; a changed file, a damaged cache file or another dtype
    converts again; "off" writes nothing."""
    import jax

    from prefixscore.model import loader, weights_cache
    from prefixscore.model.loader import load_model

    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(make_torch_model("qwen3", seed=7), "qwen3", path, Q.Q8_0)
    first = load_model(str(path))
    cached = sorted((tmp_path / "cache" / "weights").glob("*.safetensors"))
    assert len(cached) == 1

    convert = loader.load_gguf
    calls = []
    monkeypatch.setattr(loader, "load_gguf", lambda *a: calls.append(a) or convert(*a))
    again = load_model(str(path))
    assert calls == [] and again.cfg == first.cfg
    same = jax.tree.map(
        lambda a, b: a.dtype == b.dtype and bool((np.asarray(a) == np.asarray(b)).all()), first.params, again.params
    )
    assert all(jax.tree.leaves(same))

    cached[0].write_bytes(b"not a safetensors file")
    load_model(str(path))
    assert len(calls) == 1
    load_model(str(path), "bfloat16")
    assert len(calls) == 2
    write_gguf(make_torch_model("qwen3", seed=8), "qwen3", path, Q.Q8_0)  # the file changes
    changed = load_model(str(path))
    assert len(calls) == 3 and not np.array_equal(np.asarray(changed.params.embed), np.asarray(first.params.embed))
    assert len(list((tmp_path / "cache" / "weights").glob("*.safetensors"))) == 3

    monkeypatch.setenv(weights_cache.ENV, "off")
    monkeypatch.setenv("PREFIXSCORE_CACHE", str(tmp_path / "other"))
    load_model(str(path))
    assert len(calls) == 4 and not (tmp_path / "other").exists()
