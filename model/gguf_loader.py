"""GGUF checkpoints (llama.cpp): config from metadata, tensors under HF names.

A projection in a block format model/gguf_blocks.py splits (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K,
Q6_K) is read as its 8-bit values and block scales, exactly: kept so on the device unless
`--quantize none` (model/quant_choice.py). Every other tensor (norms, the embedding, the output
head, other formats) is dequantized to float as llama.cpp's own dequantization computes it."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from prefixscore.model.config import ModelConfig, UnsupportedModelError
from prefixscore.model.config_inventory import Effect, gguf_field
from prefixscore.model.families import DECODERS, GGUF_ARCHITECTURES, DecoderFamily, GgufRules, Windows
from prefixscore.model.gguf_blocks import split_blocks
from prefixscore.model.quant import QuantizedMatrix
from prefixscore.model.quant_choice import ProjectionConverter
from prefixscore.model.weights import (
    PROJECTIONS,
    HostTensor,
    Place,
    Weights,
    check_all_used,
    on_default_device,
    params_from_hf_tensors,
)

# GGUF tensor name (inside blk.{i}.) -> HF name (inside model.layers.{i}.)
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 2/3 (post-norms): ffn_norm is the pre-MLP norm, and two more norms per layer
GGUF_POST_NORM_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # read into the config (llama3 RoPE), not a weight


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _check_metadata(reader, arch: str, cfg: ModelConfig) -> None:
    """Every metadata key through the inventory (model/config_inventory.py): an unknown key
    under the architecture's prefix, or a value not computed exactly, refuses the load."""
    for key, field in reader.fields.items():
        entry = gguf_field(key, arch)
        if entry is None:
            raise UnsupportedModelError(
                f"GGUF metadata {key} is not in prefixscore's inventory: whether it changes scores is unknown"
            )
        if entry.effect is Effect.INERT:  # tokenizer arrays are large: never decoded here
            continue
        refusal = entry.refusal(field.contents(), cfg)
        if refusal:
            raise UnsupportedModelError(f"GGUF {refusal.replace('{arch}', arch)}")


def _rope_freq_factors(reader) -> tuple[float, ...]:
    """llama3 RoPE as llama.cpp stores it: a divisor per frequency (the rope_freqs tensor)."""
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            from gguf.quants import dequantize

            return tuple(float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1))
    return ()


def gguf_config(reader, name: str = "") -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` keys), every key checked against the inventory."""
    arch = _field(reader, "general.architecture")
    decoder = GGUF_ARCHITECTURES.get(arch)
    if decoder is None:
        raise UnsupportedModelError(
            f"GGUF general.architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    rules = decoder.gguf
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") if f"{arch}.vocab_size" not in reader.fields else None
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    tied = "output.weight" not in {t.name for t in reader.tensors}
    # a window the graph reads none of stays out of the config: the inventory then refuses it
    window = _field(reader, f"{arch}.attention.sliding_window") if rules.windows is not Windows.NONE else None
    layers = int(_field(reader, f"{arch}.block_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    linear = _field(reader, f"{arch}.rope.scaling.type") == "linear"  # other types: refused below
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    cfg = ModelConfig(
        family=decoder.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=tied,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        qkv_bias=decoder.qkv_bias,
        qk_norm=decoder.qk_norm,
        rope_freq_factors=_rope_freq_factors(reader),
        rope_scaling=(("rope_type", "linear"), ("factor", factor)) if linear else (),
        sliding_window=int(window) if window else None,
        sliding_layers=_sliding_layers(rules, layers),
        rope_local_theta=rules.local_rope_theta,
        hidden_act=decoder.activation,
        norm_plus_one=decoder.norm_plus_one,
        post_norms=decoder.post_norms,
        scale_embeddings=decoder.scale_embeddings,
        attn_scale=_attn_scale(decoder, layers, hidden // heads, head_dim),
        attn_softcap=_soft_cap(reader, f"{arch}.attn_logit_softcapping") if decoder.attn_softcap else None,
        final_softcap=_soft_cap(reader, f"{arch}.final_logit_softcapping") if decoder.final_softcap else None,
        name=name,
    )
    _check_metadata(reader, arch, cfg)
    return cfg


def _sliding_layers(rules: GgufRules, layers: int) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp fixes it by architecture (not stored); (): every layer (or none)."""
    if rules.windows is not Windows.PER_LAYER:
        return ()
    slides = tuple((i + 1) % rules.swa_pattern != 0 for i in range(layers))  # every swa_pattern-th attends fully
    return slides if any(slides) else ()


def _attn_scale(decoder: DecoderFamily, layers: int, width: int, head_dim: int) -> float | None:
    """llama.cpp's query scale: 1/sqrt(head_dim), or 1/sqrt(hidden / heads) at the 27B shapes' layer
    count; None (head_dim ** -0.5 implied) where the decoder states no scale."""
    if not decoder.scaled_queries:
        return None
    wide = layers == decoder.gguf.wide_query_scale_layers
    return (width if wide else head_dim) ** -0.5


def _soft_cap(reader, key: str) -> float | None:
    """A soft cap stored under `key`; None where absent or 0 (no cap)."""
    cap = _field(reader, key)
    return float(cap) if cap else None


def _layer_name(gguf_name: str, post_norms: bool) -> str | None:
    """The HF name of a per-layer GGUF tensor ("blk.3.attn_q.weight"), None for any other."""
    parts = gguf_name.split(".", 2)
    names = {**GGUF_LAYER_NAMES, **GGUF_POST_NORM_NAMES} if post_norms else GGUF_LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def _unpermute_rope(w: HostTensor, n_heads: int) -> HostTensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> HF rotate-half layout). w: [out, in]
    (8-bit: its values, scales and offsets, all by output row).

    convert_hf_to_gguf.py reshapes rows to [heads, 2, hd/2] and swaps the last two;
    the inverse reshapes to [heads, hd/2, 2] and swaps back.
    """
    if isinstance(w, QuantizedMatrix):
        offset = None if w.offset is None else _unpermute_rope(w.offset, n_heads)
        return w.replace(
            values=_unpermute_rope(w.values, n_heads), scale=_unpermute_rope(w.scale, n_heads), offset=offset
        )
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str | Path, dtype: jnp.dtype, place: Place = on_default_device, convert: ProjectionConverter | None = None
) -> tuple[ModelConfig, Weights]:
    """Read a GGUF file, each weight handed to `place` (model/weights.py) as it is assembled:
    projections in a block format as 8-bit blocks (then as `convert` decides), everything else
    dequantized (F32/F16/BF16, and the formats without an 8-bit layout here)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    reader = GGUFReader(str(path))
    cfg = gguf_config(reader, name=path.stem)
    rules = DECODERS[cfg.family].gguf
    by_hf_name = {}
    unknown = []
    for t in reader.tensors:
        if t.name in GGUF_GLOBAL_NAMES:
            by_hf_name[GGUF_GLOBAL_NAMES[t.name]] = t
        elif (hf_name := _layer_name(t.name, cfg.post_norms)) is not None:
            by_hf_name[hf_name] = t
        elif t.name != ROPE_FREQS:
            unknown.append(t.name)
    check_all_used(unknown, set())  # a tensor no HF name maps to is never read
    used: set[str] = set()

    def get(name: str) -> HostTensor:
        used.add(name)
        t = by_hf_name[name]
        shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists dims innermost first
        blocks = split_blocks(t.data, t.tensor_type, shape) if name.split(".", 3)[-1] in PROJECTIONS else None
        if blocks is not None:
            w: HostTensor = QuantizedMatrix(values=blocks.values, scale=blocks.scale, offset=blocks.offset)
        else:
            w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if rules.rope_permuted_qk and name.endswith("q_proj.weight"):
            w = _unpermute_rope(w, cfg.num_heads)
        elif rules.rope_permuted_qk and name.endswith("k_proj.weight"):
            w = _unpermute_rope(w, cfg.num_kv_heads)
        elif rules.norms_stored_plus_one and name.endswith("norm.weight"):
            w = w - 1.0  # back to the checkpoint's weight: the decoder adds the 1 (norm_plus_one)
        return w

    params = params_from_hf_tensors(cfg, get, dtype, lambda n: n in by_hf_name, place, convert)
    check_all_used(by_hf_name, used)
    return cfg, params
