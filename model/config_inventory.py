"""Every config field the loader can meet, and what it does to the forward pass.

A checkpoint's `config.json` is parsed by transformers' own config class for its model type,
so defaults and legacy spellings (`rope_scaling`, a top-level `rope_theta`, Qwen's derived
`layer_types`, Mistral's default window of 4,096) are exactly transformers'. model/config.py
then walks the family's inventory below, and model/gguf_loader.py walks GGUF_KEYS, before a
ModelConfig exists. Each field is one of:

- COMPUTED: read into ModelConfig and computed exactly, at any value;
- LIMITED: computed exactly at the values `accepts` admits; any other value refuses the load
  with a message naming the field and its value;
- INERT: cannot change a score (`why` says why).

A field of transformers' class that is missing here refuses the load: a new family or a
new transformers release cannot slip a field past (tests/test_config_inventory.py checks
the installed classes). `trials` are configurations that set the field to a non-default
value it computes, `refused` ones at values its `accepts` rejects; the inventory test builds a
tiny checkpoint from each (2 layers, head_dim 16) and checks that a trial scores exactly as
transformers does and a refused one is refused naming the field, so a field added here is
tested without another line of test code, and a value that stops being computed fails it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

from prefixscore.model.families import DECODERS, GGUF_ARCHITECTURES, DecoderFamily, Windows


class Effect(enum.Enum):
    COMPUTED = "computed"
    LIMITED = "limited"
    INERT = "inert"


def _any(value: Any, cfg: Any) -> bool:
    return True


def _never(value: Any, cfg: Any) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field: its effect on the forward pass, why, and the values computed exactly."""

    name: str  # the config.json key; "rope_parameters.<key>" for a key of that dict
    effect: Effect
    why: str
    # LIMITED: whether a value is computed exactly, given the config read so far (a GGUF
    # file's ModelConfig, or transformers' config object)
    accepts: Callable[[Any, Any], bool] = _any
    # configurations (config overrides) that set a non-default value computed exactly: the
    # inventory test holds each to transformers
    trials: tuple[Mapping[str, Any], ...] = ()
    # configurations at values `accepts` rejects: the inventory test sees each refused, naming the field
    refused: tuple[Mapping[str, Any], ...] = ()

    def refusal(self, value: Any, cfg: Any) -> str | None:
        """The message refusing `value`, or None when it is computed exactly (or inert)."""
        if not self.accepts(value, cfg):
            return f"{self.name}={value!r} is not supported: {self.why}"
        return None


COMPUTED, LIMITED, INERT = Effect.COMPUTED, Effect.LIMITED, Effect.INERT


def _equals(expected: Any) -> Callable[[Any, Any], bool]:
    return lambda v, cfg: v == expected


# transformers' PretrainedConfig fields, shared by every family
_BASE = (
    Field(
        "architectures",
        COMPUTED,
        "chooses the family (with model_type) and the output head: *ForCausalLM, *ForSequenceClassification "
        "where CLASSIFIERS lists it, or none for a base *Model where BASE_MODELS lists it",
    ),
    Field("transformers_version", INERT, "the writer's version"),
    Field("output_hidden_states", INERT, "what a forward pass returns, not what it computes"),
    Field("return_dict", INERT, "what a forward pass returns, not what it computes"),
    Field("dtype", INERT, "the stored dtype; weights are converted to the served --dtype"),
    Field("chunk_size_feed_forward", INERT, "not read by these decoders"),
    Field("is_encoder_decoder", INERT, "not read by these decoders"),
    Field("id2label", INERT, "labels of a classification head; a causal LM has none"),
    Field("label2id", INERT, "labels of a classification head; a causal LM has none"),
    Field("problem_type", INERT, "the loss of a classification head; a causal LM has none"),
)

_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 32,
}


def _rope(**params: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **params}}


ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")  # as model/decoder.py computes them
# as model/rope.py computes them; dynamic and longrope follow each sequence's length (refused)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _activation(
    name: str, trials: tuple[Mapping[str, Any], ...] = (), refused: tuple[Mapping[str, Any], ...] = ()
) -> Field:
    return Field(
        name,
        LIMITED,
        f"the MLP's activation; {', '.join(ACTIVATIONS)} are computed",
        accepts=lambda v, cfg: v in ACTIVATIONS,
        trials=trials,
        refused=refused,
    )


_SHAPES = (
    Field("vocab_size", COMPUTED, "the embedding's and the vocabulary head's rows"),
    Field("hidden_size", COMPUTED, "the residual stream's width"),
    Field("intermediate_size", COMPUTED, "the MLP's width"),
    Field("num_hidden_layers", COMPUTED, "the number of decoder layers"),
    Field("num_attention_heads", COMPUTED, "query heads"),
    Field("num_key_value_heads", COMPUTED, "key/value heads (grouped-query attention)"),
    Field(
        "max_position_embeddings",
        COMPUTED,
        "the longest sequence served (context_length); longer requests are refused",
        trials=({"max_position_embeddings": 64},),
    ),
    Field("rms_norm_eps", COMPUTED, "every RMSNorm's epsilon", trials=({"rms_norm_eps": 1e-2},)),
    Field(
        "tie_word_embeddings",
        COMPUTED,
        "the vocabulary head is the embedding",
        trials=({"tie_word_embeddings": True}, {"tie_word_embeddings": False}),
    ),
    Field("rope_parameters", COMPUTED, "a dict; each key is listed as rope_parameters.<key>"),
)
_LLAMA_ACT = _activation("hidden_act", trials=({"hidden_act": "gelu"},), refused=({"hidden_act": "relu"},))

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
_YARN_RAMP = _rope(**_YARN, attention_factor=0.8, beta_fast=16.0, beta_slow=2.0, truncate=False)
_YARN_MSCALE = _rope(**_YARN, mscale=2.0, mscale_all_dim=1.0)


def _rope_fields(prefix: str = "rope_parameters", tried: bool = True) -> tuple[Field, ...]:
    """The keys of one RoPE parameter dict (a nested one per layer type for Gemma 3)."""

    def trials(*t: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
        return t if tried else ()

    return (
        Field(
            f"{prefix}.rope_type",
            LIMITED,
            f"RoPE frequencies: {', '.join(ROPE_TYPES)} are computed; dynamic and longrope are not "
            "(their frequencies follow each sequence's length, so a query's cached keys would differ per item)",
            accepts=lambda v, cfg: v in ROPE_TYPES,
            trials=trials({"rope_parameters": _LLAMA3}, _rope(rope_type="linear", factor=2.0), _rope(**_YARN)),
            refused=trials(
                _rope(rope_type="dynamic", factor=2.0),
                _rope(
                    rope_type="longrope",
                    short_factor=[1.0] * 8,
                    long_factor=[2.0] * 8,
                    factor=2.0,
                    original_max_position_embeddings=64,
                ),
            ),
        ),
        Field(f"{prefix}.rope_theta", COMPUTED, "the RoPE base", trials=trials(_rope(rope_theta=100.0))),
        Field(
            f"{prefix}.partial_rotary_factor",
            LIMITED,
            "RoPE on part of each head is not computed (only 1.0)",
            accepts=lambda v, cfg: v == 1.0,
            refused=trials(_rope(partial_rotary_factor=0.5)),
        ),
        Field(f"{prefix}.factor", COMPUTED, "the scaling factor of linear, llama3 and yarn RoPE"),
        *(Field(f"{prefix}.{key}", COMPUTED, "llama3 RoPE scaling") for key in ("low_freq_factor", "high_freq_factor")),
        Field(f"{prefix}.original_max_position_embeddings", COMPUTED, "the pretraining length (llama3, yarn)"),
        *(
            Field(f"{prefix}.{key}", COMPUTED, "YaRN's ramp and attention factor", trials=trials(_YARN_RAMP))
            for key in ("attention_factor", "beta_fast", "beta_slow", "truncate")
        ),
        *(
            Field(f"{prefix}.{key}", COMPUTED, "YaRN's attention factor", trials=trials(_YARN_MSCALE))
            for key in ("mscale", "mscale_all_dim")
        ),
        Field(f"{prefix}.type", INERT, "the legacy name of rope_type, which transformers reads instead"),
        *(
            Field(f"{prefix}.{key}", INERT, "read only by longrope, refused above")
            for key in ("short_factor", "long_factor")
        ),
    )


_COMMON = (
    Field("initializer_range", INERT, "random initialisation only; weights are loaded"),
    Field("use_cache", INERT, "generation's KV cache; scoring keeps its own"),
    Field("pad_token_id", INERT, "the embedding's padding row only matters in training"),
    Field("bos_token_id", INERT, "a token id (the tokenizer adds start tokens), not math"),
    Field("eos_token_id", INERT, "a token id for generation"),
    Field("attention_dropout", INERT, "dropout is off in inference", trials=({"attention_dropout": 0.5},)),
)

_DECODER = (*_BASE, *_SHAPES, *_COMMON)
# RoPE is one computation for every family: Llama's inventory tries its options, the others'
# take them as computed (their tiny checkpoints still run default RoPE at their own bases)
_ROPE = _rope_fields(tried=False)

_HEAD_DIM = Field("head_dim", COMPUTED, "each head's width (not always hidden / heads)", trials=({"head_dim": 32},))


def _attention_bias(why: str) -> Field:
    return Field("attention_bias", COMPUTED, why, trials=({"attention_bias": True},))


_QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": 48}
_QWEN_WINDOWS = (
    Field(
        "use_sliding_window",
        COMPUTED,
        "sliding-window attention on layers from max_window_layers on",
        trials=({**_QWEN_WINDOW, "max_window_layers": 1}, {"use_sliding_window": False, "sliding_window": 48}),
    ),
    Field(
        "sliding_window",
        COMPUTED,
        "the window of the sliding layers",
        trials=({**_QWEN_WINDOW, "max_window_layers": 0},),
    ),
    Field(
        "max_window_layers",
        COMPUTED,
        "layers below it attend fully; none windowed needs no cap",
        trials=({**_QWEN_WINDOW, "max_window_layers": 2},),
    ),
    Field(
        "layer_types",
        COMPUTED,
        "each layer's attention: full_attention or sliding_attention",
        accepts=lambda v, cfg: set(v) <= {"full_attention", "sliding_attention"},
        trials=({**_QWEN_WINDOW, "layer_types": ["full_attention", "sliding_attention"]},),
    ),
)


# Gemma's own fields (every Gemma has these); 2 and 3 add _GEMMA2
_GEMMA = (
    *(dataclasses.replace(f, trials=()) for f in _DECODER),
    dataclasses.replace(_HEAD_DIM, trials=()),
    _attention_bias("biases on the q, k, v and o projections"),
    Field(
        "use_bidirectional_attention",
        LIMITED,
        "bidirectional attention (embedding models) is not computed",
        accepts=lambda v, cfg: not v,
    ),
)
_GEMMA2 = (
    Field("query_pre_attn_scalar", COMPUTED, "the attention softmax's scale is its inverse square root"),
    Field("final_logit_softcapping", COMPUTED, "vocabulary logits soft-capped at cap * tanh(logit / cap)"),
    Field("sliding_window", COMPUTED, "the window of the sliding layers"),
    Field(
        "layer_types",
        COMPUTED,
        "each layer's attention: full_attention or sliding_attention",
        accepts=lambda v, cfg: set(v) <= {"full_attention", "sliding_attention"},
    ),
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model type the loader accepts: where its config comes from and what computes it. Model
    types share a decoder (Mistral runs Llama's), so the decoder's traits are its own record."""

    architecture: str  # config.json's architectures[0]
    config_class: str  # transformers' config class that parses config.json
    decoder: DecoderFamily  # the decoder that computes it (its name is ModelConfig.family)
    # which layers transformers' modelling of this type slides: a property of the model type, not
    # the decoder (Llama's reads no window, Mistral's slides every layer, Qwen's per layer_types)
    windows: Windows
    fields: tuple[Field, ...]  # the class's fields, with the other keys its modelling code reads


FAMILIES: dict[str, Family] = {  # by model_type
    "llama": Family(
        "LlamaForCausalLM",
        "LlamaConfig",
        DECODERS["llama"],
        Windows.NONE,
        (
            *_DECODER,
            _LLAMA_ACT,
            *_rope_fields(),
            _HEAD_DIM,
            _attention_bias("biases on the q, k, v and o projections"),
            Field(
                "mlp_bias",
                LIMITED,
                "biases on the MLP projections are not computed",
                accepts=lambda v, cfg: not v,
                refused=({"mlp_bias": True},),
            ),
            Field("pretraining_tp", INERT, "transformers 5 does not read it", trials=({"pretraining_tp": 2},)),
        ),
    ),
    "mistral": Family(  # Llama's decoder with a window
        "MistralForCausalLM",
        "MistralConfig",
        DECODERS["llama"],
        Windows.EVERY_LAYER,
        (
            *_DECODER,
            _LLAMA_ACT,
            *_ROPE,
            _HEAD_DIM,
            Field(
                "sliding_window",
                COMPUTED,
                "sliding-window attention on every layer (transformers' default: 4,096)",
                trials=({"sliding_window": 48}, {"sliding_window": None}),
            ),
        ),
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        DECODERS["qwen2"],
        Windows.PER_LAYER,
        (*_DECODER, _LLAMA_ACT, *_ROPE, _HEAD_DIM, *_QWEN_WINDOWS),
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM",
        "Qwen3Config",
        DECODERS["qwen3"],
        Windows.PER_LAYER,
        (
            *_DECODER,
            _LLAMA_ACT,
            *_ROPE,
            _HEAD_DIM,
            _attention_bias("biases on the q, k, v and o projections"),
            *_QWEN_WINDOWS,
        ),
    ),
    # Gemma: the tests' tiny checkpoints set every computed field to a non-default value
    # (tests/conftest.py), so these families add few trials of their own
    "gemma": Family(
        "GemmaForCausalLM",
        "GemmaConfig",
        DECODERS["gemma"],
        Windows.NONE,
        (*_GEMMA, _activation("hidden_act"), *_ROPE),
    ),
    "gemma2": Family(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        DECODERS["gemma2"],
        Windows.PER_LAYER,
        (
            *_GEMMA,
            *_GEMMA2,
            Field("attn_logit_softcapping", COMPUTED, "attention logits soft-capped at cap * tanh(logit / cap)"),
            _activation("hidden_activation"),
            *_ROPE,
        ),
    ),
    "gemma3_text": Family(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        DECODERS["gemma3"],
        Windows.PER_LAYER,
        (
            *_GEMMA,
            *_GEMMA2,
            Field("attn_logit_softcapping", INERT, "transformers' Gemma 3 attention does not read it"),
            _activation("hidden_activation"),
            Field("rope_parameters.full_attention", COMPUTED, "full layers' RoPE; each key listed below"),
            Field("rope_parameters.sliding_attention", COMPUTED, "sliding layers' RoPE; each key listed below"),
            *_rope_fields("rope_parameters.full_attention", tried=False),
            *(
                dataclasses.replace(
                    f, effect=LIMITED, why="sliding layers' RoPE: plain RoPE only", accepts=_equals("default")
                )
                if f.name.endswith(".rope_type")
                else f
                for f in _rope_fields("rope_parameters.sliding_attention", tried=False)
            ),
        ),
    ),
}

# the base models: config.json's architectures[0] -> the model type whose decoder they are, with
# no output head (transformers' *Model: its final-normed hidden states). What sentence-transformers
# saves as an embedding model's Transformer module (e5-mistral's MistralModel, a Qwen3Model
# fine-tune): served for embeddings only (engine/requests/embedding.py)
BASE_MODELS: dict[str, str] = {
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
    "GemmaModel": "gemma",
    "Gemma2Model": "gemma2",
    "Gemma3TextModel": "gemma3_text",
}

# the sequence classifiers: config.json's architectures[0] -> the model type whose decoder runs
# under it. The head is data, not a family: transformers' GenericForSequenceClassification puts
# one `score` projection [num_labels, hidden] (no bias) on any decoder and reads it at the last
# token, so a family's classifier is one entry here.
CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "GemmaForSequenceClassification": "gemma",
    "Gemma2ForSequenceClassification": "gemma2",
    "Gemma3TextForSequenceClassification": "gemma3_text",
}

# a classifier's config: these replace the INERT entries of the family's (and num_labels, which
# transformers derives from id2label, may be written as a key of its own)
CLASSIFIER_FIELDS: tuple[Field, ...] = (
    Field("id2label", COMPUTED, "the classifier's label names, in the order of its score rows"),
    Field("label2id", COMPUTED, "the inverse of id2label (transformers keeps the two consistent)"),
    Field("num_labels", COMPUTED, "the score projection's rows: one logit per label"),
    Field(
        "problem_type",
        LIMITED,
        "the default activation of the logits: multi_label_classification a sigmoid per label; otherwise a "
        "sigmoid for one label, a softmax over several",
        accepts=lambda v, cfg: v in (None, "regression", "single_label_classification", "multi_label_classification"),
    ),
    Field(
        "pad_token_id",
        COMPUTED,
        "transformers reads the last token that is not the pad token; a sequence ending in it is refused "
        "(everywhere else the last token is read)",
    ),
)

# keys outside transformers' classes that a config.json may hold, read by the loader itself
EXTRA_KEYS: tuple[Field, ...] = (
    Field("model_type", COMPUTED, "chooses transformers' config class"),
    Field(
        "quantization_config",
        LIMITED,
        "compressed-tensors checkpoints are read (model/compressed.py: each of their keys is in "
        "QUANTIZATION_KEYS); other methods (GPTQ, AWQ, bitsandbytes, fp8) are not",
        accepts=lambda v, cfg: isinstance(v, dict) and v.get("quant_method") == "compressed-tensors",
    ),
    Field("auto_map", LIMITED, "custom modelling code is not run", accepts=_never),
)


# compressed-tensors' quantization_config (model/compressed.py), every key its 0.20 models define:
# top-level ones, a config group's ("config_groups.*.<key>") and its quantization arguments'
# ("config_groups.*.weights.<key>", "config_groups.*.input_activations.<key>"). `accepts` gets
# the value and every key of the config by these names. Tested by tests/test_quantization_loading.py.
_FORMATS_8BIT = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")


def _group_count(v: Any, flat: Any) -> bool:
    return isinstance(v, dict) and len(v) == 1 and all(isinstance(g, dict) for g in v.values())


def _none_or_empty(v: Any, flat: Any) -> bool:
    return not v


def _weights_type(flat: Any) -> str:
    return str((flat.get("config_groups.*.weights") or {}).get("type", "int")).lower()


def _args_fields(prefix: str, why: str, strategies: tuple[str, ...], dynamic: Callable[[Any, Any], bool]) -> tuple:
    return (
        Field(f"{prefix}.num_bits", LIMITED, f"{why}: 8 bits only (int4 and fp4 are not computed)", accepts=_equals(8)),
        Field(
            f"{prefix}.type",
            LIMITED,
            f"{why}: int (int8) or float (fp8 e4m3); activations of the weights' type",
            accepts=lambda v, flat: (
                str(v).lower() in ("int", "float")
                and (prefix.endswith("weights") or str(v).lower() == _weights_type(flat))
            ),
        ),
        Field(f"{prefix}.symmetric", LIMITED, f"{why}: symmetric only (no zero point)", accepts=_equals(True)),
        Field(
            f"{prefix}.strategy",
            LIMITED,
            f"{why}: {' or '.join(strategies)} only (group, block and tensor_group scales are not computed)",
            accepts=lambda v, flat: str(v).lower() in strategies,
        ),
        Field(
            f"{prefix}.group_size",
            LIMITED,
            f"{why}: no groups (null, or -1: per channel)",
            accepts=lambda v, flat: v in (None, -1),
        ),
        Field(f"{prefix}.block_structure", LIMITED, f"{why}: no blocks", accepts=_none_or_empty),
        Field(f"{prefix}.dynamic", LIMITED, f"{why}: {dynamic.__doc__}", accepts=dynamic),
        Field(f"{prefix}.actorder", LIMITED, f"{why}: no activation ordering (GPTQ)", accepts=_none_or_empty),
        Field(f"{prefix}.scale_dtype", LIMITED, f"{why}: scales in a float dtype as stored", accepts=_none_or_empty),
        Field(f"{prefix}.zp_dtype", LIMITED, f"{why}: no zero point", accepts=_none_or_empty),
        Field(f"{prefix}.observer", INERT, "how calibration chose the scales; the stored scales are read"),
        Field(f"{prefix}.observer_kwargs", INERT, "the calibration observer's settings"),
    )


def _weights_dynamic(v: Any, flat: Any) -> bool:
    """stored scales (dynamic false) only"""
    return v is False


def _inputs_dynamic(v: Any, flat: Any) -> bool:
    """per-token scales at run time (dynamic true, strategy token) or one stored scale (false, tensor)"""
    strategy = str(flat.get("config_groups.*.input_activations.strategy", "")).lower()
    return (v is True and strategy == "token") or (v is False and strategy == "tensor")


QUANTIZATION_KEYS: tuple[Field, ...] = (
    Field("quant_method", LIMITED, "compressed-tensors only", accepts=_equals("compressed-tensors")),
    Field(
        "format",
        LIMITED,
        f"8-bit formats: {', '.join(_FORMATS_8BIT)} (pack-quantized at 8 bits)",
        accepts=lambda v, flat: v in _FORMATS_8BIT,
    ),
    Field(
        "quantization_status",
        LIMITED,
        "weights saved compressed (or frozen) only",
        accepts=lambda v, flat: v in ("compressed", "frozen"),
    ),
    Field("global_compression_ratio", INERT, "a statistic of the compression"),
    Field("version", INERT, "the compressed-tensors version that wrote the checkpoint"),
    Field("ignore", COMPUTED, "the Linear modules kept in full precision, held to the tensors"),
    Field(
        "kv_cache_scheme", LIMITED, "an 8-bit KV cache is not served: the pool stays in --dtype", accepts=_none_or_empty
    ),
    Field("sparsity_config", LIMITED, "sparse weights are not computed", accepts=_none_or_empty),
    Field("moe_sparsity_config", LIMITED, "expert pruning is not computed", accepts=_none_or_empty),
    Field("transform_config", LIMITED, "rotations (Hadamard transforms) are not computed", accepts=_none_or_empty),
    Field("config_groups", LIMITED, "one group, written out (not a preset's name)", accepts=_group_count),
    Field(
        "config_groups.*.targets",
        LIMITED,
        "every Linear layer (the ignore list excepted)",
        accepts=lambda v, flat: list(v or ()) == ["Linear"],
    ),
    Field(
        "config_groups.*.format",
        LIMITED,
        f"8-bit formats: {', '.join(_FORMATS_8BIT)}",
        accepts=lambda v, flat: v is None or v in _FORMATS_8BIT,
    ),
    Field(
        "config_groups.*.weights",
        LIMITED,
        "8-bit weights (a group without them is not quantized)",
        accepts=lambda v, flat: isinstance(v, dict),
    ),
    Field("config_groups.*.input_activations", COMPUTED, "none (W8A16), per token at run time, or a stored scale"),
    Field("config_groups.*.output_activations", LIMITED, "outputs are not quantized", accepts=_none_or_empty),
    *_args_fields("config_groups.*.weights", "weights", ("channel", "tensor"), _weights_dynamic),
    *_args_fields("config_groups.*.input_activations", "activations", ("token", "tensor"), _inputs_dynamic),
)


@dataclasses.dataclass(frozen=True)
class GgufTrial:
    """A GGUF file written from a tiny transformers model built with `hf` overrides, with
    `metadata` set on top (`{arch}` stands for the architecture)."""

    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _head_dim(value: Any, cfg: Any) -> bool:
    return value == cfg.head_dim


_NO_ROPE_SCALING = (
    "RoPE scaling in GGUF metadata: linear (rope.scaling.type linear with its factor) is computed, other types "
    "and a factor without the linear type are not (llama3 factors come as rope_freqs.weight)"
)
_LINEAR_GGUF = {"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 2.0}

# GGUF metadata keys ("{arch}." the architecture's prefix) and tensors; a key under "{arch}."
# or outside general.*, tokenizer.*, GGUF.* that is not listed refuses the load
GGUF_KEYS: tuple[Field, ...] = (
    Field("general.architecture", COMPUTED, f"the family: {', '.join(GGUF_ARCHITECTURES)}"),
    Field("general.*", INERT, "names, license, file type: each tensor's own type is read and dequantized"),
    Field("GGUF.*", INERT, "the file's structure"),
    Field("tokenizer.*", INERT, "the tokenizer's; scores of token ids do not depend on them"),
    Field("{arch}.vocab_size", COMPUTED, "the vocabulary's size"),
    Field("{arch}.embedding_length", COMPUTED, "the residual stream's width"),
    Field("{arch}.feed_forward_length", COMPUTED, "the MLP's width"),
    Field("{arch}.block_count", COMPUTED, "the number of decoder layers"),
    Field("{arch}.attention.head_count", COMPUTED, "query heads"),
    Field("{arch}.attention.head_count_kv", COMPUTED, "key/value heads"),
    Field(
        "{arch}.attention.key_length",
        COMPUTED,
        "each head's width",
        trials=(GgufTrial({"{arch}.attention.key_length": 32, "{arch}.attention.value_length": 32}, {"head_dim": 32}),),
    ),
    Field(
        "{arch}.attention.value_length",
        LIMITED,
        "values as wide as keys (key_length) only",
        accepts=_head_dim,
        refused=(GgufTrial({"{arch}.attention.value_length": 8}),),
    ),
    Field(
        "{arch}.context_length",
        COMPUTED,
        "the longest sequence served",
        trials=(GgufTrial({"{arch}.context_length": 64}),),
    ),
    Field(
        "{arch}.rope.freq_base",
        COMPUTED,
        "the RoPE base",
        trials=(GgufTrial({"{arch}.rope.freq_base": 100.0}, _rope(rope_theta=100.0)),),
    ),
    Field(
        "{arch}.attention.layer_norm_rms_epsilon",
        COMPUTED,
        "every RMSNorm's epsilon",
        trials=(GgufTrial({"{arch}.attention.layer_norm_rms_epsilon": 1e-2}, {"rms_norm_eps": 1e-2}),),
    ),
    Field(
        "{arch}.rope.dimension_count",
        LIMITED,
        "RoPE on part of each head is not computed (only the head's width)",
        accepts=_head_dim,
        refused=(GgufTrial({"{arch}.rope.dimension_count": 8}),),
    ),
    Field(
        "{arch}.rope.scaling.type",
        LIMITED,
        _NO_ROPE_SCALING,
        accepts=lambda v, cfg: v in ("none", "linear"),
        trials=(GgufTrial({"{arch}.rope.scaling.type": "linear"}),),
        refused=(GgufTrial({"{arch}.rope.scaling.type": "yarn"}),),
    ),
    Field(
        "{arch}.rope.scaling.factor",
        LIMITED,
        _NO_ROPE_SCALING,
        accepts=lambda v, cfg: v == 1.0 or dict(cfg.rope_scaling).get("rope_type") == "linear",
        trials=(GgufTrial(_LINEAR_GGUF, _rope(rope_type="linear", factor=2.0)),),
        refused=(GgufTrial({"{arch}.rope.scaling.factor": 2.0}),),
    ),
    *(
        Field(key, LIMITED, _NO_ROPE_SCALING, accepts=_equals(1.0), refused=(GgufTrial({key: 2.0}),))
        for key in ("{arch}.rope.scale_linear", "{arch}.rope.scaling.attn_factor")
    ),
    *(
        Field(key, INERT, "read only under a rope.scaling.type, which is refused")
        for key in ("{arch}.rope.scaling.original_context_length", "{arch}.rope.scaling.finetuned")
    ),
    *(
        Field(f"{{arch}}.{kind}_logit_softcapping", COMPUTED, f"Gemma 2/3's soft cap of {what} logits")
        for kind, what in (("attn", "attention"), ("final", "vocabulary"))
    ),
    Field(
        "{arch}.attention.sliding_window",
        LIMITED,
        "sliding-window attention where the architecture's graph reads one (model/families.py); a Gemma 1 "
        "file's is not computed (llama.cpp's Gemma graph reads none)",
        accepts=lambda v, cfg: cfg.sliding_window == (v or None),  # computed exactly when the config took it
        # the oracle slides too (Mistral's class stands in for a llama file)
        trials=(
            GgufTrial(
                {"{arch}.attention.sliding_window": 48},
                {"sliding_window": 48, "use_sliding_window": True, "max_window_layers": 0},
            ),
        ),
    ),
    *(
        Field(
            key,
            LIMITED,
            "mixture-of-experts layers are not computed",
            accepts=_equals(0),
            refused=(GgufTrial({key: 4}),),
        )
        for key in ("{arch}.expert_count", "{arch}.expert_used_count")
    ),
    Field(
        "{arch}.attention.clamp_kqv",
        LIMITED,
        "clamped q/k/v projections are not computed",
        accepts=_never,
        refused=(GgufTrial({"{arch}.attention.clamp_kqv": 8.0}),),
    ),
    Field(
        "{arch}.attention.layer_norm_epsilon",
        LIMITED,
        "LayerNorm (not RMSNorm) is not computed",
        accepts=_never,
        refused=(GgufTrial({"{arch}.attention.layer_norm_epsilon": 1e-5}),),
    ),
    Field(
        "{arch}.attention.causal",
        LIMITED,
        "bidirectional attention is not computed",
        accepts=_equals(True),
        refused=(GgufTrial({"{arch}.attention.causal": False}),),
    ),
    *(
        Field(
            key,
            LIMITED,
            "scaled logits, embeddings or residuals are not computed",
            accepts=_equals(1.0),
            refused=(GgufTrial({key: 2.0}),),
        )
        for key in ("{arch}.logit_scale", "{arch}.embedding_scale", "{arch}.residual_scale")
    ),
    Field(
        "{arch}.attention.scale",
        LIMITED,
        "an attention scale other than 1/sqrt(head width) is not computed",
        accepts=_never,
        refused=(GgufTrial({"{arch}.attention.scale": 0.5}),),
    ),
    Field(
        "{arch}.pooling_type",
        LIMITED,
        "embedding models (pooled outputs) are not scored",
        accepts=_equals(0),
        refused=(GgufTrial({"{arch}.pooling_type": 1}),),
    ),
    Field(
        "split.count",
        LIMITED,
        "split GGUF files are not read; merge them first",
        accepts=_equals(1),
        refused=(GgufTrial({"split.count": 2}),),
    ),
    Field("split.*", INERT, "the position of a file in a split set of one"),
    Field(
        "rope_freqs.weight",
        COMPUTED,
        "a tensor: llama3 RoPE frequency factors (each frequency divided by its factor)",
        trials=(GgufTrial(hf={"rope_parameters": _LLAMA3}),),
    ),
)


def family_fields(model_type: str, classifier: bool = False) -> dict[str, Field]:
    """The inventory of one model type, by name (KeyError: not a family the loader serves);
    `classifier`: of its *ForSequenceClassification (CLASSIFIER_FIELDS computed)."""
    return {f.name: f for f in (*FAMILIES[model_type].fields, *EXTRA_KEYS, *(CLASSIFIER_FIELDS if classifier else ()))}


def gguf_field(key: str, arch: str) -> Field | None:
    """The inventory entry of GGUF metadata key `key` for architecture `arch` (None: unknown)."""
    for field in GGUF_KEYS:
        pattern = field.name.replace("{arch}", arch)
        if pattern == key or (pattern.endswith(".*") and key.startswith(pattern[:-1])):
            return field
    return None
