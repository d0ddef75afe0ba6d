"""GGUF files written as llama.cpp's converter (convert_hf_to_gguf.py) writes them, from a tiny
transformers model: the tests' independent picture of the format (its own tensor names, q/k
permutation and Gemma norm offset, not the loader's tables)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

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


# gguf-py cannot quantize the K-quants: a tensor in one is random super-blocks (every bit pattern of the
# packed values and 6-bit scales is a valid block) whose float16 super-block scales are set for weights of
# the float tensor's size; the torch model then takes their dequantization, as for any other type.
# type -> (offsets of the float16 fields d (and dmin), largest |value x sub-block scale|: 15 x 63, 31 x 63, 32 x 127)
K_QUANTS = {Q.Q4_K: ((0, 2), 15 * 63), Q.Q5_K: ((0, 2), 31 * 63), Q.Q6_K: ((208,), 32 * 127)}


def k_quant_blocks(t: np.ndarray, qtype: Q, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random `qtype` super-blocks with weights up to about max |t|."""
    rows, cols = t.shape
    super_block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // super_block, type_size), dtype=np.uint8)
    fields, reach = K_QUANTS[qtype]
    size = float(np.abs(t).max()) / reach
    for at in fields:  # both signs: nothing in the format makes d or dmin positive
        d = rng.uniform(-size, size, size=(len(raw), 1)).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def _add_metadata(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, value)


def write_gguf(model, family: str, path, qtype: Q | Callable[[str], Q], metadata: dict | None = None) -> None:
    """Write `model` as llama.cpp would, 2-D weights in `qtype` (or in `qtype(gguf tensor name)`: a
    file of mixed types, as Q4_K_M); load the dequantized weights back into `model` so that it is the
    exact oracle for what the file holds. `metadata` adds or replaces keys ("{arch}" stands for the
    architecture)."""
    type_of = qtype if callable(qtype) else lambda name: qtype
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
        elif t.ndim == 2 and (q := type_of(gname)) != Q.F32:
            data = k_quant_blocks(t, q, seed=len(state)) if q in K_QUANTS else quantize(t, q)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=q)
            back = dequantize(data, q).reshape(t.shape)
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
