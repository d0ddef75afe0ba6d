"""The decoder's weights as typed pytrees, and every source of them: Hugging Face tensors
(safetensors, single or sharded; GGUF goes through the same names) and random presets.

Every source ends in `params_from_hf_tensors` (or builds the same tree), so there is one
place that knows the layout model/decoder.py reads. Per-layer weights are stacked on a
leading layer axis: the layers run under one `lax.scan`, which keeps compile time
independent of depth. Flat names ("layers.attn.wq") are what the on-disk cache of
converted weights stores (model/weights_cache.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from prefixscore.model.config import ModelConfig, UnsupportedModelError
from prefixscore.model.head import OutputHead, output_head


def _axes(*axes: str | None, optional: bool = False):
    """A weight field named by its logical axes (one per dimension; the fused `*_heads` axes
    hold heads x head_dim): engine/mesh.py maps them to mesh axes with one rule table."""
    if optional:
        return struct.field(default=None, metadata={"axes": axes})
    return struct.field(metadata={"axes": axes})


@struct.dataclass
class AttentionWeights:
    """One projection each of q, k, v and the output, stacked over layers."""

    wq: jax.Array = _axes("layers", "embed", "q_heads")  # [layers, hidden, heads * hd]
    wk: jax.Array = _axes("layers", "embed", "kv_heads")  # [layers, hidden, kv_heads * hd]
    wv: jax.Array = _axes("layers", "embed", "kv_heads")  # [layers, hidden, kv_heads * hd]
    wo: jax.Array = _axes("layers", "q_heads", "embed")  # [layers, heads * hd, hidden]
    # projection biases (ModelConfig.qkv_bias)
    bq: jax.Array | None = _axes("layers", "q_heads", optional=True)  # [layers, heads * hd]
    bk: jax.Array | None = _axes("layers", "kv_heads", optional=True)  # [layers, kv_heads * hd]
    bv: jax.Array | None = _axes("layers", "kv_heads", optional=True)  # [layers, kv_heads * hd]
    # the output projection's bias (ModelConfig.out_bias), added once after the heads are summed
    bo: jax.Array | None = _axes("layers", "embed", optional=True)  # [layers, hidden]
    # Qwen3's RMSNorm of each q and k head
    q_norm: jax.Array | None = _axes("layers", "head_dim", optional=True)  # [layers, hd]
    k_norm: jax.Array | None = _axes("layers", "head_dim", optional=True)  # [layers, hd]


@struct.dataclass
class MlpWeights:
    """The gated MLP, stacked over layers."""

    w_gate: jax.Array = _axes("layers", "embed", "mlp")  # [layers, hidden, inter]
    w_up: jax.Array = _axes("layers", "embed", "mlp")  # [layers, hidden, inter]
    w_down: jax.Array = _axes("layers", "mlp", "embed")  # [layers, inter, hidden]


@struct.dataclass
class LayerWeights:
    """Every decoder layer's weights, stacked on the leading layer axis (one scan runs them)."""

    attn_norm: jax.Array = _axes("layers", "embed")  # [layers, hidden]
    mlp_norm: jax.Array = _axes("layers", "embed")  # [layers, hidden]
    attn: AttentionWeights
    mlp: MlpWeights
    # Gemma 2/3 (ModelConfig.post_norms): norms of the attention and MLP outputs
    attn_post_norm: jax.Array | None = _axes("layers", "embed", optional=True)  # [layers, hidden]
    mlp_post_norm: jax.Array | None = _axes("layers", "embed", optional=True)  # [layers, hidden]


@struct.dataclass
class Weights:
    """The decoder's weights (model/decoder.py). Linear weights are [in, out]."""

    embed: jax.Array = _axes("vocab", "embed")  # [vocab, hidden]
    final_norm: jax.Array = _axes("embed")  # [hidden]
    layers: LayerWeights
    lm_head: jax.Array | None = _axes("vocab", "embed", optional=True)  # [vocab, hidden]; None: tied to embed
    # a classifier's head (model/head.py) instead of the vocabulary's: small, so its
    # "labels" axis has no mesh rule and every device holds it whole
    score: jax.Array | None = _axes("labels", "embed", optional=True)  # [num_labels, hidden]


def weight_axes() -> dict[str, tuple[str | None, ...]]:
    """Every weight's logical axes by its flat name ("layers.attn.wq": ("layers", "embed", "q_heads"))."""

    def walk(cls: type, prefix: str) -> dict[str, tuple[str | None, ...]]:
        out: dict[str, tuple[str | None, ...]] = {}
        for f in dataclasses.fields(cls):
            if "axes" in f.metadata:
                out[prefix + f.name] = f.metadata["axes"]
            else:  # a nested group
                out.update(walk(_GROUPS[f.name], f"{prefix}{f.name}."))
        return out

    return walk(Weights, "")


_GROUPS: dict[str, type] = {"layers": LayerWeights, "attn": AttentionWeights, "mlp": MlpWeights}


# flat layer name -> (HF name inside model.layers.{i}., transpose to [in, out])
LAYER_TENSORS: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "attn.wq": ("self_attn.q_proj.weight", True),
    "attn.wk": ("self_attn.k_proj.weight", True),
    "attn.wv": ("self_attn.v_proj.weight", True),
    "attn.wo": ("self_attn.o_proj.weight", True),
    "attn.bq": ("self_attn.q_proj.bias", False),
    "attn.bk": ("self_attn.k_proj.bias", False),
    "attn.bv": ("self_attn.v_proj.bias", False),
    "attn.bo": ("self_attn.o_proj.bias", False),
    "attn.q_norm": ("self_attn.q_norm.weight", False),
    "attn.k_norm": ("self_attn.k_norm.weight", False),
    "mlp.w_gate": ("mlp.gate_proj.weight", True),
    "mlp.w_up": ("mlp.up_proj.weight", True),
    "mlp.w_down": ("mlp.down_proj.weight", True),
}
# Gemma 2/3 name their norms by place: post_attention_layernorm is the attention output's norm
# there (Llama's pre-MLP norm elsewhere); the pre-MLP norm is pre_feedforward_layernorm
POST_NORM_TENSORS: dict[str, tuple[str, bool]] = {
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "attn_post_norm": ("post_attention_layernorm.weight", False),
    "mlp_post_norm": ("post_feedforward_layernorm.weight", False),
}


def layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """The per-layer weights this configuration has: flat name -> (HF name, transpose)."""
    names = {**LAYER_TENSORS, **POST_NORM_TENSORS} if cfg.post_norms else LAYER_TENSORS
    return {key: names[key] for key in layer_keys(cfg)}


def layer_keys(cfg: ModelConfig) -> list[str]:
    """The flat names of the per-layer weights this configuration has."""
    keys = ["attn_norm", "mlp_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down"]
    if cfg.qkv_bias:
        keys += ["attn.bq", "attn.bk", "attn.bv"]
    if cfg.out_bias:
        keys += ["attn.bo"]
    if cfg.qk_norm:
        keys += ["attn.q_norm", "attn.k_norm"]
    if cfg.post_norms:
        keys += ["attn_post_norm", "mlp_post_norm"]
    return keys


def weights_from_flat(flat: Mapping[str, jax.Array]) -> Weights:
    """The tree from flat names ("embed", "layers.attn.wq", ...); absent optional ones are None."""

    def group(prefix: str) -> dict[str, jax.Array]:
        """The arrays named `prefix` + a field name (not those of a deeper group)."""
        fields = {name[len(prefix) :]: array for name, array in flat.items() if name.startswith(prefix)}
        return {field: array for field, array in fields.items() if "." not in field}

    return Weights(
        embed=flat["embed"],
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
        score=flat.get("score"),
        layers=LayerWeights(
            **group("layers."), attn=AttentionWeights(**group("layers.attn.")), mlp=MlpWeights(**group("layers.mlp."))
        ),
    )


def flat_weights(weights: Weights) -> dict[str, jax.Array]:
    """The inverse of `weights_from_flat`: every array under its dotted name (None fields left out)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(weights)
    return {".".join(key.name for key in path): array for path, array in leaves}


# where a weight goes once read: (flat name, host array in the served dtype) -> the array kept
Place = Callable[[str, np.ndarray], jax.Array | np.ndarray]


def on_default_device(name: str, array: np.ndarray) -> jax.Array:
    """The whole weight on the default device (one device; a mesh places them itself)."""
    return jnp.asarray(array)


def on_host(name: str, array: np.ndarray) -> np.ndarray:
    """The weight kept on the host (converted weights on their way to the on-disk cache)."""
    return array


def place_all(weights: Weights, place: Place) -> Weights:
    """Every weight of a tree through `place` (by its flat name)."""
    return weights_from_flat({name: place(name, array) for name, array in flat_weights(weights).items()})


def params_from_hf_tensors(
    cfg: ModelConfig,
    get: Callable[[str], np.ndarray],
    dtype: jnp.dtype,
    has: Callable[[str], bool],
    place: Place = on_default_device,
) -> Weights:
    """Assemble the weights from HF-named tensors ([out, in] linear weights).

    get(name) returns a float numpy array; has(name) says whether it exists. Each weight is
    cast to `dtype` on the host and handed to `place` as soon as it is assembled (a mesh
    sends each device only its slice), so peak host memory stays at one stacked weight.
    """
    host_dtype = jnp.dtype(dtype)

    def put(name: str, a: np.ndarray) -> jax.Array | np.ndarray:
        # C order: a stack of transposed layers keeps their strides, which a file writer or a
        # device transfer would otherwise read as the wrong layout
        return place(name, np.ascontiguousarray(np.asarray(a).astype(host_dtype)))

    flat: dict[str, jax.Array | np.ndarray] = {}
    for key, (name, transpose) in layer_tensors(cfg).items():
        per_layer = []
        for i in range(cfg.num_layers):
            full = f"model.layers.{i}.{name}"
            if not has(full):
                raise ValueError(f"model weights: tensor {full!r} is missing")
            t = np.asarray(get(full), dtype=np.float32)
            per_layer.append((t.T if transpose else t).astype(host_dtype))
        flat[f"layers.{key}"] = put(f"layers.{key}", np.stack(per_layer))
        del per_layer
    flat["embed"] = put("embed", get("model.embed_tokens.weight"))
    flat["final_norm"] = put("final_norm", get("model.norm.weight"))
    head = output_head(cfg)
    if head.weight is not None:  # a projection of its own: a classifier's score rows, an untied lm_head
        if not has(head.tensor):
            raise ValueError(_missing_head(head))
        projection = get(head.tensor)
        if np.shape(projection) != head.shape:  # on the host: placement may pad a split vocabulary
            raise ValueError(
                f"model weights: {head.tensor} has shape {np.shape(projection)}, "
                f"config says {head.shape} (rows, hidden_size)"
            )
        flat[head.weight] = put(head.weight, projection)
    if flat["embed"].shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"model weights: embed_tokens has shape {flat['embed'].shape}, "
            f"config says {(cfg.vocab_size, cfg.hidden_size)}"
        )
    return weights_from_flat(flat)


# checkpoint tensors transformers itself drops on load: RoPE tables that older Llama
# checkpoints saved as buffers (recomputed from the config, as here)
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


def load_safetensors(
    model_dir: str | Path, cfg: ModelConfig, dtype: jnp.dtype, place: Place = on_default_device
) -> Weights:
    """Load `model.safetensors` or a sharded `model.safetensors.index.json` checkpoint.

    Every tensor of the checkpoint must be read: one the config does not use (a bias the
    config does not declare, a head the architecture lacks) would be read past and the
    scores silently wrong, so the load fails naming it."""
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
    used = {name for name in weight_map if name.endswith(IGNORED_TENSOR_SUFFIXES)}

    def get(name: str) -> np.ndarray:
        used.add(name)
        return handle(weight_map[name]).get_tensor(name)

    def has(name: str) -> bool:
        return name in weight_map

    head = output_head(cfg)
    if head.tensor is not None and head.tensor not in weight_map:  # before reading every layer
        raise ValueError(_missing_head(head))
    params = params_from_hf_tensors(cfg, _float32(get), dtype, has, place)
    if head.tied and "lm_head.weight" in weight_map:
        # a tied head saved anyway is harmless only when it is the embedding
        if not np.array_equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
            raise UnsupportedModelError(
                "model weights: lm_head.weight differs from the embedding but config.json says tie_word_embeddings=true"
            )
    check_all_used(weight_map, used)
    return params


def _missing_head(head: OutputHead) -> str:
    return f"model weights: {head.tensor} is missing {head.weight_needed_because}"


def check_all_used(names: Iterable[str], used: set[str]) -> None:
    """Refuses a checkpoint with tensors the decoder did not read (named, the first few)."""
    unused = sorted(set(names) - used)
    if unused:
        shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise UnsupportedModelError(
            f"model weights: {len(unused)} checkpoint tensor(s) the configuration does not use: {shown} "
            "(serving without them would give wrong scores)"
        )


def _float32(get: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """safetensors returns bf16 as a numpy dtype only through ml_dtypes; widen everything to f32."""

    def wrapped(name: str) -> np.ndarray:
        return np.asarray(get(name)).astype(np.float32)

    return wrapped


def weight_bytes(cfg: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes of the whole model's weights in `dtype` (from the shapes alone, nothing built)."""
    shapes = jax.eval_shape(lambda: random_params(cfg, 0, dtype))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def random_params(cfg: ModelConfig, seed: int, dtype: jnp.dtype) -> Weights:
    """Deterministic random weights (std 0.02, norms near 1) built on the device, no host copy.

    Same seed, same config -> the same weights on every run and backend (threefry).
    """
    hd, h, inter, L = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    shapes = {
        "attn_norm": (L, h),
        "mlp_norm": (L, h),
        "attn_post_norm": (L, h),
        "mlp_post_norm": (L, h),
        "attn.wq": (L, h, cfg.num_heads * hd),
        "attn.wk": (L, h, cfg.num_kv_heads * hd),
        "attn.wv": (L, h, cfg.num_kv_heads * hd),
        "attn.wo": (L, cfg.num_heads * hd, h),
        "attn.bq": (L, cfg.num_heads * hd),
        "attn.bk": (L, cfg.num_kv_heads * hd),
        "attn.bv": (L, cfg.num_kv_heads * hd),
        "attn.bo": (L, h),
        "attn.q_norm": (L, hd),
        "attn.k_norm": (L, hd),
        "mlp.w_gate": (L, h, inter),
        "mlp.w_up": (L, h, inter),
        "mlp.w_down": (L, inter, h),
    }
    keys = layer_keys(cfg)
    head = output_head(cfg)

    @jax.jit
    def build(key: jax.Array) -> Weights:
        ks = jax.random.split(key, len(keys) + 3)

        def draw(k: jax.Array, shape: tuple[int, ...], name: str) -> jax.Array:
            noise = jax.random.normal(k, shape, jnp.float32)
            if name.endswith("norm"):
                return (1.0 + 0.1 * noise).astype(dtype)
            return (0.02 * noise).astype(dtype)

        flat = {f"layers.{name}": draw(k, shapes[name], name) for name, k in zip(keys, ks[3:], strict=True)}
        flat["embed"] = draw(ks[0], (cfg.vocab_size, h), "embed")
        flat["final_norm"] = draw(ks[1], (h,), "final_norm")
        if head.weight is not None:
            flat[head.weight] = draw(ks[2], head.shape, head.weight)
        return weights_from_flat(flat)

    return build(jax.random.key(seed))
