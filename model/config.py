"""Model configuration from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3 families;
their causal LMs and sequence classifiers).

transformers' own config class for the model type parses the file (its defaults, legacy
spellings and derived fields are the oracle's), and every field is walked through the
inventory (model/config_inventory.py): computed exactly, refused naming the field and its
value, served with the context capped at a sliding window, or inert.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from prefixscore.model import config_inventory

# architectures[0] in config.json -> the model type whose config class and inventory apply
ARCHITECTURES = {
    **{family.architecture: model_type for model_type, family in config_inventory.FAMILIES.items()},
    **config_inventory.CLASSIFIERS,
}


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
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2; Llama/Qwen3 attention_bias)
    out_bias: bool = False  # a bias on the attention output projection (Llama/Qwen3 attention_bias)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    # llama3 RoPE frequency scaling as (key, value) pairs (factor, low/high_freq_factor,
    # original_max_position_embeddings); () means plain RoPE
    rope_scaling: tuple[tuple[str, float], ...] = ()
    # per-frequency divisors [head_dim // 2] (a GGUF file's rope_freqs tensor); () means none
    rope_freq_factors: tuple[float, ...] = ()
    # the narrowest sliding attention window of any layer (None: every layer attends fully);
    # served by capping the context at it, inside which a window changes nothing
    sliding_window: int | None = None
    # the output head at each item's last token: 0, the vocabulary (a causal LM's next-token
    # probabilities of label tokens); n, a classifier's `score` projection [n, hidden] and its
    # n logits (*ForSequenceClassification: no vocabulary head at all)
    num_labels: int = 0
    # a classifier's label names (id2label, in row order) and whether its problem_type is
    # multi_label_classification (a sigmoid per label by default): names, not math
    label_names: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    multi_label: bool = dataclasses.field(default=False, compare=False)
    # a classifier's pad token: transformers reads the last token that is not it, so a sequence
    # ending in it is refused (engine/validation.py); None: no pad token, or a causal LM
    pad_token_id: int | None = dataclasses.field(default=None, compare=False)
    # the name is not math: configs that differ only by name share compiled executables
    name: str = dataclasses.field(default="", compare=False)

    @property
    def context_length(self) -> int:
        """The longest sequence served: the model's positions, capped at a sliding window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        fields["rope_scaling"] = tuple(tuple(pair) for pair in fields["rope_scaling"])  # JSON made lists
        fields["rope_freq_factors"] = tuple(fields["rope_freq_factors"])
        fields["label_names"] = tuple(fields.get("label_names", ()))
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
    for key, value in (hf.rope_parameters or {}).items():
        values[f"rope_parameters.{key}"] = value
    for name, value in values.items():
        field = inventory.get(name)
        if field is None:  # only rope_parameters keys get here: class fields were checked above
            raise UnsupportedModelError(f"config.json {name}={value!r} is not in prefixscore's inventory")
        refusal = field.refusal(value, hf)
        if refusal:
            raise UnsupportedModelError(f"config.json {refusal}")
    return values


def _sliding_window(model_type: str, hf: Any) -> int | None:
    """The window of the layers that slide (None: none does), as transformers' modelling reads it."""
    if model_type == "llama":  # transformers' Llama has no window (a sliding_window key is read past)
        return None
    window = hf.sliding_window
    if model_type == "mistral" or window is None:  # Mistral: every layer, whenever a window is set
        return window
    return window if "sliding_attention" in hf.layer_types else None


def config_from_dict(raw: dict[str, Any], name: str = "") -> ModelConfig:
    """Build a ModelConfig from the parsed contents of a HF config.json."""
    model_type = _model_type(raw)
    hf = _transformers_config(model_type, raw)
    archs = raw.get("architectures") or []
    classifier = bool(archs) and archs[0] in config_inventory.CLASSIFIERS
    values = _checked_values(model_type, raw, hf, classifier)
    rope = hf.rope_parameters
    rope_scaling: tuple[tuple[str, float], ...] = ()
    if rope["rope_type"] == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        rope_scaling = tuple((k, float(rope[k])) for k in keys)
    # Llama and Qwen3: attention_bias on q, k, v and o; Qwen2: on q, k, v always; Mistral: none
    attention_bias = bool(values.get("attention_bias", False))
    num_heads = int(hf.num_attention_heads)
    return ModelConfig(
        family=config_inventory.FAMILIES[model_type].decoder,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(hf.num_key_value_heads or num_heads),
        head_dim=int(values.get("head_dim") or hf.hidden_size // num_heads),
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(hf.rms_norm_eps),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        max_position_embeddings=int(hf.max_position_embeddings),
        qkv_bias=model_type == "qwen2" or attention_bias,
        out_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        rope_scaling=rope_scaling,
        sliding_window=_sliding_window(model_type, hf),
        num_labels=int(hf.num_labels) if classifier else 0,
        label_names=tuple(str(hf.id2label[i]) for i in range(hf.num_labels)) if classifier else (),
        multi_label=classifier and hf.problem_type == "multi_label_classification",
        pad_token_id=hf.pad_token_id if classifier else None,
        name=name,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` from a local Hugging Face model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    return config_from_dict(json.loads(path.read_text()), name=Path(model_dir).name)
