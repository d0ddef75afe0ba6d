"""GGUF loading: metadata -> config, dequantization (F32, F16, Q8_0, Q4_0, Q4_1), llama.cpp's q/k permutation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import SMALL_BUCKETS, make_torch_model, torch_label_probs
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from prefixscore import Scorer
from prefixscore.model.config import UnsupportedModelError

HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# Gemma 2/3 (post-norms): llama.cpp names the norms by place
HF_TO_GGUF_POST_NORMS = {
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
GEMMA = ("gemma", "gemma2", "gemma3")


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The divisor of each RoPE frequency that llama.cpp's converter stores as rope_freqs.weight
    for a llama3-scaled model: 1 for short wavelengths, `factor` for long ones, a blend between."""
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / inv
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended)).astype(np.float32)


def _add_metadata(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, value)


def write_gguf(model, family: str, path, qtype: Q, metadata: dict | None = None) -> None:
    """Write `model` as llama.cpp would, 2-D weights in `qtype`; load the dequantized weights back
    into `model` so that it is the exact oracle for what the file holds. `metadata` adds or
    replaces keys ("{arch}" stands for the architecture)."""
    cfg = model.config
    arch = family
    w = GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the full layers'
    to_gguf = {**HF_TO_GGUF_LAYER, **HF_TO_GGUF_POST_NORMS} if family in GEMMA[1:] else HF_TO_GGUF_LAYER
    keys = {
        "{arch}.block_count": cfg.num_hidden_layers,
        "{arch}.context_length": cfg.max_position_embeddings,
        "{arch}.embedding_length": cfg.hidden_size,
        "{arch}.feed_forward_length": cfg.intermediate_size,
        "{arch}.attention.head_count": cfg.num_attention_heads,
        "{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        "{arch}.rope.freq_base": float(rope["rope_theta"]),
        "{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "{arch}.vocab_size": cfg.vocab_size,
        "{arch}.attention.key_length": head_dim,
        "{arch}.attention.value_length": head_dim,
        "{arch}.rope.dimension_count": head_dim,
        **_gemma_metadata(cfg, family),
        **(
            {"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": float(rope["factor"])}
            if rope["rope_type"] == "linear"
            else {}
        ),
        **(metadata or {}),
    }
    for key, value in keys.items():
        _add_metadata(w, key.replace("{arch}", arch), value)
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    state = {}
    for name, tensor in model.state_dict().items():
        t = tensor.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            gname = f"blk.{i}.{to_gguf[rest]}"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if family == "llama" and name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        elif family == "llama" and name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        if family in GEMMA and name.endswith("norm.weight"):  # llama.cpp stores Gemma's as 1 + weight
            w.add_tensor(gname, t + 1.0)
            back = t
        elif t.ndim == 2 and qtype != Q.F32:
            data = quantize(t, qtype)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
            back = dequantize(data, qtype).reshape(t.shape)
        else:
            w.add_tensor(gname, t)
            back = t
        if family == "llama" and name.endswith("q_proj.weight"):
            back = llama_cpp_permute_inverse(back, cfg.num_attention_heads)
        elif family == "llama" and name.endswith("k_proj.weight"):
            back = llama_cpp_permute_inverse(back, cfg.num_key_value_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(back))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(state, strict=False)


def _gemma_metadata(cfg, family: str) -> dict:
    """The keys llama.cpp's converter writes for Gemma 2/3: the soft caps and the window."""
    if family not in GEMMA[1:]:
        return {}
    caps = {
        f"{{arch}}.{kind}_logit_softcapping": float(getattr(cfg, f"{kind}_logit_softcapping"))
        for kind in ("attn", "final")
        if getattr(cfg, f"{kind}_logit_softcapping")
    }
    return {**caps, "{arch}.attention.sliding_window": cfg.sliding_window}


def llama_cpp_permute_inverse(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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
    got = np.array(scorer.score(QUERY, ITEMS, LABELS))
    want = torch_label_probs(model, [QUERY + it for it in ITEMS], LABELS, False)
    assert np.abs(got - want).max() <= 1e-4
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
