"""Each decoder family's traits as data: what a checkpoint of the family means beyond its stored
numbers. Both loaders read these records (model/config.py for a config.json, model/gguf_loader.py
for a GGUF file) to fill a ModelConfig; nothing else compares a family's name. The forward pass
reads only the ModelConfig fields these traits set, so a new family enters as one record here
(and its config.json model types in model/config_inventory.py).
"""

from __future__ import annotations

import dataclasses
import enum


class Windows(enum.Enum):
    """Which layers a configured sliding window applies to, as the family's modelling reads it."""

    NONE = "none"  # no layer: transformers reads past a window; a GGUF file's is refused (the inventory)
    EVERY_LAYER = "every layer"
    # some layers: those config.json's layer_types names sliding; in GGUF, llama.cpp's fixed pattern
    PER_LAYER = "per layer"


@dataclasses.dataclass(frozen=True)
class GgufRules:
    """How llama.cpp stores one family: its architecture name, what its converter changes in the
    tensors, and what its graph fixes by architecture rather than reading from metadata."""

    architecture: str  # general.architecture, and the "{arch}." prefix of the family's metadata keys
    # convert_hf_to_gguf.py interleaves each q/k head's rows for llama.cpp's RoPE; the loader undoes it
    rope_permuted_qk: bool = False
    norms_stored_plus_one: bool = False  # the converter stores each RMSNorm weight as 1 + weight
    windows: Windows = Windows.EVERY_LAYER  # the layers {arch}.attention.sliding_window applies to
    swa_pattern: int = 0  # PER_LAYER: every swa_pattern-th layer attends fully, the others slide
    local_rope_theta: float | None = None  # the sliding layers' RoPE base (plain RoPE); None: rope_theta
    # the layer count at which queries scale by 1/sqrt(hidden / heads) instead of 1/sqrt(head width)
    # (llama.cpp keys its 27B rule on the shape); None: never
    wide_query_scale_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class DecoderFamily:
    """One decoder (ModelConfig.family) and the options every checkpoint of it has, whatever its
    file says; the options a file does state (shapes, RoPE, windows, cap values) are read from it."""

    name: str  # ModelConfig.family
    gguf: GgufRules
    norm_plus_one: bool = False  # every RMSNorm scales by 1 + weight
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    post_norms: bool = False  # norms on the attention and MLP outputs, before each residual add
    qk_norm: bool = False  # RMSNorm on each q and k head before RoPE
    qkv_bias: bool = False  # q, k and v biased whatever attention_bias says
    # the attention scale is stated, not head_dim ** -0.5 by default: config.json's
    # query_pre_attn_scalar ** -0.5, or llama.cpp's rule for a GGUF file (GgufRules)
    scaled_queries: bool = False
    attn_softcap: bool = False  # a stated attention-logit soft cap is applied (else read past)
    final_softcap: bool = False  # a stated vocabulary-logit soft cap is applied (else read past)
    activation: str = "silu"  # the MLP's activation where the file names none (GGUF)


_GEMMA = DecoderFamily(
    "gemma",
    GgufRules("gemma", norms_stored_plus_one=True, windows=Windows.NONE),  # llama.cpp's Gemma graph reads no window
    norm_plus_one=True,
    scale_embeddings=True,
    final_softcap=True,
    activation="gelu_pytorch_tanh",
)
# llama.cpp (llama-model.cpp): Gemma 2 slides on every other layer, Gemma 3 on five of six with a
# local base of 10,000; both scale queries by 1/sqrt(hidden / heads) in their 27B shapes only
_GEMMA2 = dataclasses.replace(
    _GEMMA,
    name="gemma2",
    gguf=GgufRules(
        "gemma2", norms_stored_plus_one=True, windows=Windows.PER_LAYER, swa_pattern=2, wide_query_scale_layers=46
    ),
    post_norms=True,
    scaled_queries=True,
    attn_softcap=True,
)
_GEMMA3 = dataclasses.replace(
    _GEMMA2,
    name="gemma3",
    gguf=GgufRules(
        "gemma3",
        norms_stored_plus_one=True,
        windows=Windows.PER_LAYER,
        swa_pattern=6,
        local_rope_theta=10000.0,
        wide_query_scale_layers=62,
    ),
    qk_norm=True,
    attn_softcap=False,  # Gemma 3's attention reads no soft cap (transformers' and llama.cpp's alike)
)
DECODERS: dict[str, DecoderFamily] = {
    decoder.name: decoder
    for decoder in (
        DecoderFamily("llama", GgufRules("llama", rope_permuted_qk=True)),
        DecoderFamily("qwen2", GgufRules("qwen2"), qkv_bias=True),
        DecoderFamily("qwen3", GgufRules("qwen3"), qk_norm=True),
        _GEMMA,
        _GEMMA2,
        _GEMMA3,
    )
}

# general.architecture -> the decoder family a GGUF file of it runs on
GGUF_ARCHITECTURES: dict[str, DecoderFamily] = {decoder.gguf.architecture: decoder for decoder in DECODERS.values()}
