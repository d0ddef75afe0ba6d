"""GGUF loading: metadata -> config, tensors (F32, F16; Q8_0, Q4_0, Q4_1 kept 8-bit), llama.cpp's q/k permutation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SMALL_BUCKETS, make_torch_model, torch_label_probs
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from helpers.gguf_files import write_gguf

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
    scorer = Scorer.load(str(path), buckets=SMALL_BUCKETS)
    assert scorer.cfg.family == family
    assert scorer.model.tokenizer is None  # no tokenizer metadata in this file: token ids still work
    # block formats stay 8-bit on the device (W8A16: model/quant.py), float ones as they were
    assert isinstance(scorer.model.params.layers.mlp.w_up, QuantizedMatrix) == (qtype not in (Q.F16, Q.F32))
    got = np.array(scorer.score(QUERY, ITEMS, LABELS))
    want = torch_label_probs(model, [QUERY + it for it in ITEMS], LABELS, False)
    assert np.abs(got - want).max() <= 1e-5
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
    from_gguf = Scorer.load(str(tmp_path / "twin.gguf"), buckets=SMALL_BUCKETS)
    from_hf = Scorer.load(str(tmp_path / "hf"), buckets=SMALL_BUCKETS)
    assert dataclasses.replace(from_gguf.cfg, rms_norm_eps=0) == dataclasses.replace(from_hf.cfg, rms_norm_eps=0)
    got = np.array(from_gguf.score(query, ITEMS, LABELS))
    np.testing.assert_allclose(got, np.array(from_hf.score(query, ITEMS, LABELS)), atol=1e-6)
    want = torch_label_probs(model, [query + it for it in ITEMS], LABELS, False)
    assert np.abs(got - want).max() <= 1e-5


def test_a_gemma_1_file_with_a_window_is_refused(tmp_path):
    """llama.cpp's Gemma 1 graph reads no window: a file carrying one is refused, not slid."""
    path = tmp_path / "gemma.gguf"
    write_gguf(make_torch_model("gemma", seed=7), "gemma", path, Q.F32, {"{arch}.attention.sliding_window": 48})
    with pytest.raises(UnsupportedModelError, match="gemma.attention.sliding_window=48"):
        Scorer.load(str(path), buckets=SMALL_BUCKETS)


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
