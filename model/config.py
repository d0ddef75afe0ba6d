"""Model configuration from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3;
their causal LMs and sequence classifiers).

transformers' own config class for the model type parses the file (its defaults, legacy
spellings and derived fields are the oracle's), and every field is walked through the
inventory (model/config_inventory.py): computed exactly, refused naming the field and its
value, or inert.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

import prefixscore.model.hf_quiet  # noqa: F401  (before transformers: no torch advisory in the log)
from prefixscore.model import config_inventory
from prefixscore.model.compressed import CompressedScheme, CompressedTensorsError, read_scheme
from prefixscore.model.families import Windows

# architectures[0] in config.json -> the model type whose config class and inventory apply
ARCHITECTURES = {
    **{spec.architecture: model_type for model_type, spec in config_inventory.FAMILIES.items()},
    **config_inventory.CLASSIFIERS,
    **config_inventory.BASE_MODELS,
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or options are not served by this decoder."""


# the weight and pool dtypes a model can be served in (`--dtype`)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one decoder. Immutable and hashable: it is a static jit argument."""

    family: str  # the decoder (families.DECODERS): "llama" | "qwen2" | "qwen3" | "gemma" | "gemma2" | "gemma3"
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
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2; Llama/Qwen3 attention_bias)
    out_bias: bool = False  # a bias on the attention output projection (Llama/Qwen3 attention_bias)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3, Gemma 3)
    # RoPE frequency scaling as (key, value) pairs: ("rope_type", "linear" | "llama3" | "yarn")
    # and that type's parameters (model/rope.py); () means plain RoPE
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    # per-frequency divisors [head_dim // 2] (a GGUF file's rope_freqs tensor); () means none
    rope_freq_factors: tuple[float, ...] = ()
    # the window of the layers that slide (None: every layer attends fully): a token at position
    # p sees keys at positions p - sliding_window < j <= p
    sliding_window: int | None = None
    # per layer, whether it slides; () with a window: every layer does (Mistral)
    sliding_layers: tuple[bool, ...] = ()
    # Gemma 3: the sliding layers' RoPE base (plain RoPE); full layers use rope_theta and rope_scaling
    rope_local_theta: float | None = None
    hidden_act: str = "silu"  # the gated MLP's activation (config_inventory.ACTIVATIONS)
    # Gemma: every RMSNorm scales by (1 + weight), multiplied in float32 before the cast
    norm_plus_one: bool = False
    # Gemma 2/3: a norm on the attention output and on the MLP output, before each residual add
    post_norms: bool = False
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the weights' dtype
    # the attention softmax's scale (Gemma 2/3: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    attn_scale: float | None = None
    attn_softcap: float | None = None  # Gemma 2: attention logits become cap * tanh(logit / cap)
    final_softcap: float | None = None  # Gemma 2: vocabulary logits likewise
    # the output head at each item's last token: 0, the vocabulary (a causal LM's next-token
    # probabilities of label tokens); n, a classifier's `score` projection [n, hidden] and its
    # n logits (*ForSequenceClassification: no vocabulary head at all)
    num_labels: int = 0
    # a base model (*Model): no output head at all, its final-normed hidden states only (embeddings)
    base_model: bool = False
    # a classifier's label names (id2label, in row order) and whether its problem_type is
    # multi_label_classification (a sigmoid per label by default): names, not math
    label_names: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    multi_label: bool = dataclasses.field(default=False, compare=False)
    # a classifier's pad token: transformers reads the last token that is not it, so a sequence
    # ending in it is refused (engine/requests/validation.py); None: no pad token, or a causal LM
    pad_token_id: int | None = dataclasses.field(default=None, compare=False)
    # the name is not math: configs that differ only by name share compiled executables
    name: str = dataclasses.field(default="", compare=False)
    # a compressed-tensors checkpoint's 8-bit projections (model/compressed.py): "int8" | "fp8", ""
    # for a full-precision one; and its activation scheme ("dynamic" | "static" | "none"). The
    # weights themselves say how they are multiplied (model/quant.py), so these are not math either
    quant_weights: str = dataclasses.field(default="", compare=False)
    quant_activations: str = dataclasses.field(default="", compare=False)
    quant_ignore: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # its full-precision Linears

    @property
    def context_length(self) -> int:
        """The longest sequence served: the model's positions (a sliding window is computed)."""
        return self.max_position_embeddings

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: the layer attends to every earlier position)."""
        slides = self.sliding_layers or (True,) * self.num_layers
        return tuple(self.sliding_window if s and self.sliding_window else None for s in slides)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        fields["rope_scaling"] = tuple(tuple(pair) for pair in fields["rope_scaling"])  # JSON made lists
        fields["rope_freq_factors"] = tuple(fields["rope_freq_factors"])
        fields["sliding_layers"] = tuple(fields["sliding_layers"])
        fields["label_names"] = tuple(fields.get("label_names", ()))
        fields["quant_ignore"] = tuple(fields.get("quant_ignore", ()))
        return cls(**fields)


def _model_type(raw: dict[str, Any]) -> str:
    """The model type whose config class parses `raw`; refuses any other architecture."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type") or (ARCHITECTURES.get(archs[0]) if archs else None)
    if archs and ARCHITECTURES.get(archs[0]) != model_type:
        raise UnsupportedModelError(
            f"config.json architectures {archs[0]!r} (model_type {model_type!r}) is not supported; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    if model_type not in config_inventory.FAMILIES:
        raise UnsupportedModelError(
            f"config.json model_type {model_type!r} is not supported; supported: {sorted(config_inventory.FAMILIES)}"
        )
    return model_type


def _transformers_config(model_type: str, raw: dict[str, Any]) -> Any:
    import transformers

    cls = getattr(transformers, config_inventory.FAMILIES[model_type].config_class)
    try:
        return cls.from_dict(raw)
    except Exception as err:  # transformers' own validation: the message names the field
        raise UnsupportedModelError(f"config.json is not a valid {cls.__name__}: {err}") from err


def _rope_values(rope: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters' keys as inventory names; a dict per layer type (Gemma 3) one level down."""
    values: dict[str, Any] = {}
    for key, value in rope.items():
        values[f"rope_parameters.{key}"] = value
        if isinstance(value, dict):
            values.update({f"rope_parameters.{key}.{k}": v for k, v in value.items()})
    return values


def _checked_values(model_type: str, raw: dict[str, Any], hf: Any, classifier: bool) -> dict[str, Any]:
    """Every inventoried value of the config, each checked (refused naming the field)."""
    inventory = config_inventory.family_fields(model_type, classifier)
    class_fields = {f.name for f in dataclasses.fields(type(hf))}
    unlisted = sorted(class_fields - inventory.keys())
    if unlisted:  # a transformers release added a field nobody has classified yet
        raise UnsupportedModelError(
            f"config fields {unlisted} of transformers' {type(hf).__name__} are not in prefixscore's inventory "
            "(model/config_inventory.py): whether they change scores is unknown"
        )
    values = {name: getattr(hf, name) for name in class_fields}
    values.update({key: getattr(hf, key, raw[key]) for key in raw if key in inventory and key not in values})
    values.update(_rope_values(hf.rope_parameters or {}))
    for name, value in values.items():
        field = inventory.get(name)
        if field is None:  # only rope_parameters keys get here: class fields were checked above
            raise UnsupportedModelError(f"config.json {name}={value!r} is not in prefixscore's inventory")
        refusal = field.refusal(value, hf)
        if refusal:
            raise UnsupportedModelError(f"config.json {refusal}")
    return values


def _windows(rule: Windows, hf: Any) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and which layers slide, as the model type's modelling in transformers reads them."""
    if rule is Windows.NONE:  # a sliding_window key is read past
        return None, ()
    window = hf.sliding_window
    if rule is Windows.EVERY_LAYER or window is None:  # every layer, whenever a window is set
        return window, ()
    slides = tuple(kind == "sliding_attention" for kind in hf.layer_types)
    return (window, slides) if any(slides) else (None, ())


# rope_parameters keys each RoPE type reads (model/rope.py), beside rope_type and rope_theta
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}


def _rope(hf: Any) -> tuple[float, tuple[tuple[str, Any], ...], float | None]:
    """RoPE base, scaling pairs and the sliding layers' own base (Gemma 3's per-type dicts)."""
    rope = hf.rope_parameters
    local = None
    if "full_attention" in rope:  # one dict per layer type; the sliding one is plain RoPE (inventory)
        local = float(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
    kind = rope.get("rope_type", "default")
    scaling = tuple((key, rope[key]) for key in _ROPE_KEYS.get(kind, ()) if rope.get(key) is not None)
    if kind == "yarn" and "truncate" not in rope:
        # transformers reads truncate from the top-level dict (True when absent)
        scaling += (("truncate", hf.rope_parameters.get("truncate", True)),)
    return float(rope["rope_theta"]), ((("rope_type", kind), *scaling) if kind != "default" else ()), local


def config_from_dict(raw: dict[str, Any], name: str = "") -> ModelConfig:
    """Build a ModelConfig from the parsed contents of a HF config.json."""
    model_type = _model_type(raw)
    hf = _transformers_config(model_type, raw)
    archs = raw.get("architectures") or []
    classifier = bool(archs) and archs[0] in config_inventory.CLASSIFIERS
    values = _checked_values(model_type, raw, hf, classifier)
    spec = config_inventory.FAMILIES[model_type]
    decoder = spec.decoder
    scheme = _compressed_scheme(raw.get("quantization_config"))
    rope_theta, rope_scaling, rope_local_theta = _rope(hf)
    window, sliding_layers = _windows(spec.windows, hf)
    # attention_bias: on q, k, v and o where the inventory lists it (Mistral's has none); a decoder
    # with qkv_bias (Qwen2) has q, k, v biases always
    attention_bias = bool(values.get("attention_bias", False))
    num_heads = int(hf.num_attention_heads)

    def optional_float(key: str) -> float | None:
        value = values.get(key)
        return None if value is None else float(value)

    return ModelConfig(
        family=decoder.name,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(hf.num_key_value_heads or num_heads),
        head_dim=int(values.get("head_dim") or hf.hidden_size // num_heads),
        rope_theta=rope_theta,
        rms_norm_eps=float(hf.rms_norm_eps),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        max_position_embeddings=int(hf.max_position_embeddings),
        qkv_bias=decoder.qkv_bias or attention_bias,
        out_bias=attention_bias,
        qk_norm=decoder.qk_norm,
        rope_scaling=rope_scaling,
        sliding_window=window,
        sliding_layers=sliding_layers,
        rope_local_theta=rope_local_theta,
        hidden_act=str(values.get("hidden_activation") or values["hidden_act"]),
        norm_plus_one=decoder.norm_plus_one,
        post_norms=decoder.post_norms,
        scale_embeddings=decoder.scale_embeddings,
        attn_scale=float(values["query_pre_attn_scalar"]) ** -0.5 if decoder.scaled_queries else None,
        attn_softcap=optional_float("attn_logit_softcapping") if decoder.attn_softcap else None,
        final_softcap=optional_float("final_logit_softcapping") if decoder.final_softcap else None,
        num_labels=int(hf.num_labels) if classifier else 0,
        base_model=bool(archs) and archs[0] in config_inventory.BASE_MODELS,
        label_names=tuple(str(hf.id2label[i]) for i in range(hf.num_labels)) if classifier else (),
        multi_label=classifier and hf.problem_type == "multi_label_classification",
        pad_token_id=hf.pad_token_id if classifier else None,
        name=name,
        quant_weights=scheme.weights if scheme else "",
        quant_activations=scheme.activations if scheme else "",
        quant_ignore=scheme.ignore if scheme else (),
    )


def _compressed_scheme(quantization_config: dict[str, Any] | None) -> CompressedScheme | None:
    """A compressed-tensors checkpoint's scheme, every key checked (model/compressed.py); None: full precision."""
    if not quantization_config:
        return None
    try:
        return read_scheme(quantization_config)
    except CompressedTensorsError as err:
        raise UnsupportedModelError(str(err)) from err


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` from a local Hugging Face model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    return config_from_dict(json.loads(path.read_text()), name=Path(model_dir).name)
