"""Model configuration from a Hugging Face `config.json` (Llama, Qwen2, Qwen3 families)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

# architectures[0] in config.json -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or options are not served by this decoder."""


# the weight and pool dtypes a model can be served in (`--dtype`)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one decoder. Immutable and hashable: it is a static jit argument."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    # llama3 RoPE frequency scaling as (key, value) pairs (factor, low/high_freq_factor,
    # original_max_position_embeddings); () means plain RoPE
    rope_scaling: tuple[tuple[str, float], ...] = ()
    bos_token_id: int | None = None
    name: str = ""


def config_from_dict(raw: dict[str, Any], name: str = "") -> ModelConfig:
    """Build a ModelConfig from the parsed contents of a HF config.json."""
    archs = raw.get("architectures") or []
    family = ARCHITECTURES.get(archs[0]) if archs else MODEL_TYPES.get(raw.get("model_type", ""))
    if family is None:
        got = archs[0] if archs else raw.get("model_type", "<missing>")
        raise UnsupportedModelError(
            f"config.json architecture {got!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"config.json hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if family == "llama" and raw.get("mlp_bias"):
        raise UnsupportedModelError("config.json mlp_bias=true is not supported")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    # transformers >= 5 writes rope settings under rope_parameters; older files at top level
    rope_params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (
        rope_params if rope_params.get("rope_type") not in (None, "default") else None
    )
    rope_theta = rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_scaling: tuple[tuple[str, float], ...] = ()
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            rope_scaling = tuple((k, float(scaling[k])) for k in keys)
        elif kind not in (None, "default"):
            raise UnsupportedModelError(f"config.json rope_scaling type {kind!r} is not supported (default, llama3)")
    attention_bias = family == "qwen2" or bool(raw.get("attention_bias", False))
    bos = raw.get("bos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        attention_bias=attention_bias,
        qk_norm=family == "qwen3",
        rope_scaling=rope_scaling,
        bos_token_id=bos if isinstance(bos, int) else None,
        name=name,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` from a local Hugging Face model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    return config_from_dict(json.loads(path.read_text()), name=Path(model_dir).name)
