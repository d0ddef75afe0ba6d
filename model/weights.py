"""Weights: Hugging Face tensors (safetensors, single or sharded) -> the decoder's parameter pytree.

Every source (safetensors, GGUF, random presets) ends in `params_from_hf_tensors`,
so there is one place that knows the layout of model/decoder.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from prefixscore.model.config import ModelConfig
from prefixscore.model.decoder import Params

# decoder key -> (HF name inside model.layers.{i}., transpose to [in, out])
LAYER_TENSORS: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def layer_keys(cfg: ModelConfig) -> list[str]:
    """The per-layer parameters this configuration has."""
    keys = ["attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
    if cfg.attention_bias:
        keys += ["bq", "bk", "bv"]
    if cfg.qk_norm:
        keys += ["q_norm", "k_norm"]
    return keys


def params_from_hf_tensors(
    cfg: ModelConfig, get: Callable[[str], np.ndarray], dtype: jnp.dtype, has: Callable[[str], bool]
) -> Params:
    """Assemble parameters from HF-named tensors ([out, in] linear weights).

    get(name) returns a float numpy array; has(name) says whether it exists.
    Layers are stacked one key at a time to keep peak host memory at one tensor stack.
    """

    def put(a: np.ndarray) -> jax.Array:
        return jnp.asarray(a, dtype=dtype)

    layers = {}
    for key in layer_keys(cfg):
        name, transpose = LAYER_TENSORS[key]
        per_layer = []
        for i in range(cfg.num_layers):
            full = f"model.layers.{i}.{name}"
            if not has(full):
                raise ValueError(f"model weights: tensor {full!r} is missing")
            t = np.asarray(get(full), dtype=np.float32)
            per_layer.append(t.T if transpose else t)
        layers[key] = put(np.stack(per_layer))
    params: Params = {
        "embed": put(get("model.embed_tokens.weight")),
        "final_norm": put(get("model.norm.weight")),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        if not has("lm_head.weight"):
            raise ValueError("model weights: lm_head.weight is missing and tie_word_embeddings is false")
        params["lm_head"] = put(get("lm_head.weight"))
    if params["embed"].shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"model weights: embed_tokens has shape {params['embed'].shape}, "
            f"config says {(cfg.vocab_size, cfg.hidden_size)}"
        )
    return params


def load_safetensors(model_dir: str | Path, cfg: ModelConfig, dtype: jnp.dtype) -> Params:
    """Load `model.safetensors` or a sharded `model.safetensors.index.json` checkpoint."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (model_dir / "model.safetensors").is_file():
        weight_map = None
    else:
        raise FileNotFoundError(f"model: no model.safetensors or model.safetensors.index.json in {model_dir}")
    handles: dict[str, object] = {}

    def handle(file: str):
        if file not in handles:
            handles[file] = safe_open(str(model_dir / file), framework="numpy")
        return handles[file]

    if weight_map is None:
        names = set(handle("model.safetensors").keys())
        weight_map = {n: "model.safetensors" for n in names}

    def get(name: str) -> np.ndarray:
        return handle(weight_map[name]).get_tensor(name)

    def has(name: str) -> bool:
        return name in weight_map

    if "lm_head.weight" not in weight_map and not cfg.tie_word_embeddings:
        raise ValueError("model weights: lm_head.weight is missing and tie_word_embeddings is false")
    return params_from_hf_tensors(cfg, _float32(get), dtype, has)


def _float32(get: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """safetensors returns bf16 as a numpy dtype only through ml_dtypes; widen everything to f32."""

    def wrapped(name: str) -> np.ndarray:
        return np.asarray(get(name)).astype(np.float32)

    return wrapped


def random_params(cfg: ModelConfig, seed: int, dtype: jnp.dtype) -> Params:
    """Deterministic random weights (std 0.02, norms near 1) built on the device, no host copy.

    Same seed, same config -> the same weights on every run and backend (threefry).
    """
    hd, h, inter, L = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    shapes = {
        "attn_norm": (L, h),
        "mlp_norm": (L, h),
        "wq": (L, h, cfg.num_heads * hd),
        "wk": (L, h, cfg.num_kv_heads * hd),
        "wv": (L, h, cfg.num_kv_heads * hd),
        "wo": (L, cfg.num_heads * hd, h),
        "bq": (L, cfg.num_heads * hd),
        "bk": (L, cfg.num_kv_heads * hd),
        "bv": (L, cfg.num_kv_heads * hd),
        "q_norm": (L, hd),
        "k_norm": (L, hd),
        "w_gate": (L, h, inter),
        "w_up": (L, h, inter),
        "w_down": (L, inter, h),
    }
    keys = layer_keys(cfg)

    @jax.jit
    def build(key: jax.Array) -> Params:
        ks = jax.random.split(key, len(keys) + 3)

        def draw(k: jax.Array, shape: tuple[int, ...], name: str) -> jax.Array:
            noise = jax.random.normal(k, shape, jnp.float32)
            if name.endswith("norm"):
                return (1.0 + 0.1 * noise).astype(dtype)
            return (0.02 * noise).astype(dtype)

        params: Params = {
            "embed": draw(ks[0], (cfg.vocab_size, h), "embed"),
            "final_norm": draw(ks[1], (h,), "final_norm"),
            "layers": {name: draw(k, shapes[name], name) for name, k in zip(keys, ks[3:], strict=True)},
        }
        if not cfg.tie_word_embeddings:
            params["lm_head"] = draw(ks[2], (cfg.vocab_size, h), "lm_head")
        return params

    return build(jax.random.key(seed))
