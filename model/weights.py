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
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

from prefixscore.model.compressed import CompressedScheme, projection_reader
from prefixscore.model.config import ModelConfig, UnsupportedModelError
from prefixscore.model.head import OutputHead, output_head
from prefixscore.model.quant import (
    NONE,
    QuantizationError,
    QuantizedMatrix,
    quantize_per_channel,
    stack_layers,
    with_activations,
)
from prefixscore.model.quant_choice import ProjectionConverter, QuantizeChoice

# a projection: full precision in the served dtype, or 8-bit values with scales (model/quant.py)
Projection = jax.Array | QuantizedMatrix


def _axes(*axes: str | None, optional: bool = False):
    """A weight field named by its logical axes (one per dimension; the fused `*_heads` axes
    hold heads x head_dim): engine/runtime/mesh.py maps them to mesh axes with one rule table."""
    if optional:
        return struct.field(default=None, metadata={"axes": axes})
    return struct.field(metadata={"axes": axes})


@struct.dataclass
class AttentionWeights:
    """One projection each of q, k, v and the output, stacked over layers."""

    wq: Projection = _axes("layers", "embed", "q_heads")  # [layers, hidden, heads * hd]
    wk: Projection = _axes("layers", "embed", "kv_heads")  # [layers, hidden, kv_heads * hd]
    wv: Projection = _axes("layers", "embed", "kv_heads")  # [layers, hidden, kv_heads * hd]
    wo: Projection = _axes("layers", "q_heads", "embed")  # [layers, heads * hd, hidden]
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

    w_gate: Projection = _axes("layers", "embed", "mlp")  # [layers, hidden, inter]
    w_up: Projection = _axes("layers", "embed", "mlp")  # [layers, hidden, inter]
    w_down: Projection = _axes("layers", "mlp", "embed")  # [layers, inter, hidden]


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

    def projection(self, head: OutputHead) -> jax.Array:
        """The head's projection [rows, hidden] (the embedding when tied)."""
        return self.embed if head.weight is None else getattr(self, head.weight)


@functools.cache
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
# the projections' HF names inside a layer: the tensors that may be 8-bit (model/quant.py)
PROJECTIONS = frozenset(name for name, projection in LAYER_TENSORS.values() if projection)
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


# the leaves of a QuantizedMatrix under a projection's flat name ("layers.attn.wq.values")
QUANTIZED_LEAVES = ("values", "scale", "offset", "input_scale")


def leaf_axes(name: str, shape: tuple[int, ...]) -> tuple[str | None, ...]:
    """The logical axes of one leaf by its flat name: a weight's own, or a quantized projection's
    part. Values take the projection's axes; scales and offsets too, with their block axis
    (per-block scales split with their input rows; one scale per channel is on every device);
    a static input scale has one per layer."""
    axes = weight_axes()
    if name in axes:
        return axes[name]
    base, _, part = name.rpartition(".")
    if part not in QUANTIZED_LEAVES or base not in axes:
        raise KeyError(f"weights: no leaf named {name!r}")
    projection = axes[base]
    if part == "values":
        return projection
    if part == "input_scale":
        return projection[:1]
    return (*projection[:-2], projection[-2] if shape[-2] > 1 else None, projection[-1])


def projections(weights: Weights) -> dict[str, Projection]:
    """The seven projections of the layers by flat name ("layers.attn.wq")."""
    return {
        **{f"layers.attn.{n}": getattr(weights.layers.attn, n) for n in ("wq", "wk", "wv", "wo")},
        **{f"layers.mlp.{n}": getattr(weights.layers.mlp, n) for n in ("w_gate", "w_up", "w_down")},
    }


def _with_projections(weights: Weights, new: dict[str, Projection]) -> Weights:
    attn = weights.layers.attn.replace(**{k.rpartition(".")[2]: v for k, v in new.items() if ".attn." in k})
    mlp = weights.layers.mlp.replace(**{k.rpartition(".")[2]: v for k, v in new.items() if ".mlp." in k})
    return weights.replace(layers=weights.layers.replace(attn=attn, mlp=mlp))


def with_activation_scheme(weights: Weights, activations: str) -> Weights:
    """Every 8-bit projection multiplied with `activations` (model/quant.py: NONE is W8A16);
    refused naming the projection where it cannot be, and where nothing is 8-bit."""
    quantized = {k: w for k, w in projections(weights).items() if isinstance(w, QuantizedMatrix)}
    if activations != NONE and not quantized:
        raise QuantizationError(
            f"--activations {activations} needs 8-bit weights, and this checkpoint is full precision: "
            "add --quantize int8 or fp8"
        )
    return _with_projections(weights, {k: with_activations(w, activations, k) for k, w in quantized.items()})


def quantized_at_load(weights: Weights, kind: str) -> Weights:
    """A full-precision tree (random presets, built whole on the device) with every projection
    quantized per output channel on the host, layer by layer."""
    new = {}
    for name, w in projections(weights).items():
        stacked = np.asarray(jax.device_get(w), dtype=np.float32)
        new[name] = jax.tree.map(jnp.asarray, stack_layers([quantize_per_channel(layer, kind) for layer in stacked]))
    return _with_projections(weights, new)


def quantization_of(weights: Weights) -> dict[str, object]:
    """What is 8-bit and how it is multiplied, for the start-up log and the model info:
    {"weights": "none"} or {"weights": "int8", "activations": "dynamic", "projections": {name: what}}."""
    quantized = {k: w for k, w in projections(weights).items() if isinstance(w, QuantizedMatrix)}
    if not quantized:
        return {"weights": NONE}
    return {
        "weights": "+".join(sorted({w.kind for w in quantized.values()})),
        "activations": "+".join(sorted({w.activations for w in quantized.values()})),
        "projections": {k: w.describe() for k, w in quantized.items()},
    }


def weights_from_flat(flat: Mapping[str, jax.Array]) -> Weights:
    """The tree from flat names ("embed", "layers.attn.wq", "layers.attn.wq.values", ...); absent
    optional ones are None. A quantized projection comes back multiplied as W8A16
    (quant.with_activations chooses otherwise)."""

    def group(prefix: str) -> dict[str, jax.Array | QuantizedMatrix]:
        """The arrays named `prefix` + a field name (not those of a deeper group)."""
        fields = {name[len(prefix) :]: array for name, array in flat.items() if name.startswith(prefix)}
        out: dict[str, jax.Array | QuantizedMatrix] = {f: a for f, a in fields.items() if "." not in f}
        for field in {f.split(".")[0] for f in fields if f.endswith(".values") and f.count(".") == 1}:
            parts = {part: fields.get(f"{field}.{part}") for part in QUANTIZED_LEAVES}
            out[field] = QuantizedMatrix(**parts)
        return out

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
    """Every weight of a tree through `place` (by its flat name); the tree keeps its structure."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(weights)
    return jax.tree.unflatten(treedef, [place(".".join(k.name for k in path), a) for path, a in leaves])


# a checkpoint tensor as a source reads it: float, or (a projection) 8-bit values with scales
# in the checkpoint's [out, in] layout
HostTensor = np.ndarray | QuantizedMatrix


def params_from_hf_tensors(
    cfg: ModelConfig,
    get: Callable[[str], HostTensor],
    dtype: jnp.dtype,
    has: Callable[[str], bool],
    place: Place = on_default_device,
    convert: ProjectionConverter | None = None,
) -> Weights:
    """Assemble the weights from HF-named tensors ([out, in] linear weights).

    get(name) returns a float numpy array, or for a projection possibly a QuantizedMatrix
    [out, in]; has(name) says whether it exists. `convert` decides what each projection becomes
    (model/quant_choice.py; None: as the checkpoint holds it, 8-bit kept). Each weight is
    cast to `dtype` on the host and handed to `place` as soon as it is assembled (a mesh
    sends each device only its slice), so peak host memory stays at one stacked weight.
    """
    host_dtype = jnp.dtype(dtype)
    convert = convert or ProjectionConverter(QuantizeChoice())

    def put(name: str, a: HostTensor) -> jax.Array | np.ndarray | QuantizedMatrix:
        # C order: a stack of transposed layers keeps their strides, which a file writer or a
        # device transfer would otherwise read as the wrong layout
        if isinstance(a, QuantizedMatrix):
            parts = {part: getattr(a, part) for part in QUANTIZED_LEAVES if getattr(a, part) is not None}
            placed = {part: place(f"{name}.{part}", np.ascontiguousarray(v)) for part, v in parts.items()}
            return a.replace(**placed)
        return place(name, np.ascontiguousarray(np.asarray(a).astype(host_dtype)))

    flat: dict[str, jax.Array | np.ndarray | QuantizedMatrix] = {}
    for key, (name, projection) in layer_tensors(cfg).items():
        per_layer: list[HostTensor] = []
        for i in range(cfg.num_layers):
            full = f"model.layers.{i}.{name}"
            if not has(full):
                raise ValueError(f"model weights: tensor {full!r} is missing")
            t = get(full)
            if projection:  # the linear weights, and only they, may be 8-bit
                per_layer.append(convert.layer(_transposed(t)))
            else:
                per_layer.append(np.asarray(t, dtype=np.float32).astype(host_dtype))
        stacked = convert.stack(f"layers.{key}", per_layer) if projection else np.stack(per_layer)
        flat[f"layers.{key}"] = put(f"layers.{key}", stacked)
        del per_layer, stacked
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


# safetensors dtypes its numpy reader (and every framework's, through it) cannot return: the fp8
# weights of compressed-tensors checkpoints, read by _read_raw as ml_dtypes arrays
NUMPY_LACKS = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _read_raw(path: Path, name: str) -> np.ndarray:
    """One tensor by the safetensors layout itself: an 8-byte little-endian header length, a JSON
    header (dtype, shape, data_offsets from the end of the header), then the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + size + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=NUMPY_LACKS[entry["dtype"]]).reshape(entry["shape"])


# checkpoint tensors transformers itself drops on load: RoPE tables that older Llama
# checkpoints saved as buffers (recomputed from the config, as here)
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


def load_safetensors(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: jnp.dtype,
    place: Place = on_default_device,
    convert: ProjectionConverter | None = None,
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
    # a base model saved alone (a *Model, as sentence-transformers saves an embedding model's
    # Transformer) names its tensors without the causal LM's "model." prefix
    unprefixed = "model.embed_tokens.weight" not in weight_map and "embed_tokens.weight" in weight_map

    def stored(name: str) -> str:
        return name.removeprefix("model.") if unprefixed else name

    def get(name: str) -> np.ndarray:
        name = stored(name)
        used.add(name)
        file = handle(weight_map[name])
        if file.get_slice(name).get_dtype() in NUMPY_LACKS:
            return _read_raw(model_dir / weight_map[name], name)
        return file.get_tensor(name)

    def has(name: str) -> bool:
        return stored(name) in weight_map

    head = output_head(cfg)
    if head.tensor is not None and head.tensor not in weight_map:  # before reading every layer
        raise ValueError(_missing_head(head))
    read: Callable[[str], HostTensor] = _float32(get)
    if cfg.quant_weights:  # a compressed-tensors checkpoint: its projections' values and scales
        scheme = CompressedScheme(cfg.quant_weights, cfg.quant_activations, cfg.quant_ignore)
        read, has = projection_reader(scheme, get, has, PROJECTIONS)
    params = params_from_hf_tensors(cfg, read, dtype, has, place, convert)
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


def _transposed(t: HostTensor) -> HostTensor:
    """A checkpoint's [out, in] projection as [in, out] (float32 unless 8-bit)."""
    if isinstance(t, QuantizedMatrix):
        return t.replace(
            values=np.asarray(t.values).T,
            scale=np.asarray(t.scale, np.float32).T,
            offset=None if t.offset is None else np.asarray(t.offset, np.float32).T,
        )
    return np.asarray(t, dtype=np.float32).T


def _float32(get: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """safetensors returns bf16 as a numpy dtype only through ml_dtypes; widen everything to f32."""

    def wrapped(name: str) -> np.ndarray:
        return np.asarray(get(name)).astype(np.float32)

    return wrapped


def weight_bytes(cfg: ModelConfig, dtype: jnp.dtype, eight_bit: bool = False) -> int:
    """Bytes of the whole model's weights in `dtype` (from the shapes alone, nothing built);
    eight_bit: the projections as a byte per weight and a float32 scale per output channel."""
    shapes = jax.eval_shape(lambda: random_params(cfg, 0, dtype))
    total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    if eight_bit:
        for w in projections(shapes).values():
            layers, _, n_out = w.shape
            total -= w.size * (w.dtype.itemsize - 1) - layers * n_out * 4
    return total


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

    wanted = {f"layers.{name}": shapes[name] for name in keys}
    wanted |= {"embed": (cfg.vocab_size, h), "final_norm": (h,)}
    if head.weight is not None:
        wanted[head.weight] = head.shape

    @jax.jit
    def build(key: jax.Array) -> Weights:
        # one normal draw cut into the weights: a generator per weight compiled one threefry
        # program each, about 2 s of XLA:CPU compile for every config a test builds
        sizes = {name: math.prod(shape) for name, shape in wanted.items()}
        noise = jax.random.normal(key, (sum(sizes.values()),), jnp.float32)
        flat, at = {}, 0
        for name, shape in wanted.items():
            part = noise[at : at + sizes[name]].reshape(shape)
            at += sizes[name]
            flat[name] = ((1.0 + 0.1 * part) if name.endswith("norm") else (0.02 * part)).astype(dtype)
        return weights_from_flat(flat)

    return build(jax.random.key(seed))
