"""A sentence-transformers checkpoint's embedding configuration, read into one record.

A directory with a `modules.json` is a sentence-transformers model: a pipeline of modules whose
last output is the embedding. prefixscore computes one pipeline exactly: the decoder (the
Transformer module, at the checkpoint root), a Pooling of its final-normed hidden states (the
last token, the mean or the first token) and, optionally, an L2 Normalize. Any other module
(Dense, LayerNorm, WordEmbeddings, a Router, ...) refuses the load naming it and its folder.

Every key of the files that configure that pipeline (the Pooling's config.json,
config_sentence_transformers.json, sentence_bert_config.json, the Normalize's config.json and
each modules.json entry) is in an inventory below, classified as model/config_inventory.py
classifies config.json's fields (COMPUTED, LIMITED, INERT, each with a `why`): a key missing
from the inventory, or a value not computed, refuses the load naming the file, the key and the
value. Legacy spellings are read as sentence-transformers 6.2 reads them, so a checkpoint saved
by an old release gets the record a new one would.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import jinja2
import jinja2.meta

from prefixscore.model.config_inventory import COMPUTED, INERT, LIMITED, Field


class SentenceConfigError(ValueError):
    """A sentence-transformers configuration prefixscore cannot compute exactly."""


@dataclasses.dataclass(frozen=True)
class Pooling:
    """What the service computes from the decoder's final-normed hidden states, and the prompts
    and similarity sentence-transformers would use with it."""

    mode: str  # "lasttoken" | "mean" | "cls": sentence-transformers' pooling_mode names
    include_prompt: bool  # False: the prompt's tokens stay out of the pool (they still condition the rest)
    normalize: bool  # a Normalize module follows the Pooling: the embedding is divided by its L2 norm
    dimension: int  # the embedding's width: the Pooling's embedding_dimension, always the hidden size
    # prompt name -> text prepended to a request's input; always holds "query" and "document", as
    # sentence-transformers' SentenceTransformer does ("" unless the checkpoint saves them), since
    # its encode_query / encode_document name them
    prompts: Mapping[str, str]
    default_prompt_name: str | None  # the prompt used when a request names none (None: no prompt)
    similarity: str  # "cosine" | "dot" | "euclidean" | "manhattan": how two embeddings compare
    # inputs longer than this many tokens are truncated by sentence-transformers (None: only the
    # model's context length bounds them): sentence_bert_config.json's max_seq_length, where older
    # releases saved it, else the tokenizer's model_max_length, where 6.2 saves it
    max_seq_length: int | None
    # texts rendered through the tokenizer's chat template (sentence-transformers 6's `message`
    # modality); None: texts are tokenized as they are, after their prompt
    chat: ChatInputs | None = None


@dataclasses.dataclass(frozen=True)
class ChatInputs:
    """sentence-transformers 6's `message` modality: each text becomes the conversation
    [system: the prompt (when there is one), user: the text], rendered by the tokenizer's chat
    template with `template_kwargs` and tokenized without adding special tokens (the template
    writes them). `restore_suffix`: a text cut to fit keeps the template's fixed tail."""

    format: str  # "flat": a message's content is the text; "structured": [{"type": "text", "text": ...}]
    template_kwargs: Mapping[str, Any]  # processing_kwargs' chat_template arguments (add_generation_prompt, ...)
    restore_suffix: bool


LAST, MEAN, CLS = "lasttoken", "mean", "cls"  # sentence-transformers' pooling_mode names
MODES = (LAST, MEAN, CLS)  # the pooling modes computed (engine/requests/pooling.py)
SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")  # SentenceTransformer.SUPPORTED_SIMILARITY_FN_NAMES
PLAIN_MODES = {"last": LAST, "mean": MEAN}  # --pooling for a plain causal LM -> its mode

_DEFAULT_PROMPTS = {"query": "", "document": ""}  # see Pooling.prompts

# modules.json "type" of each module computed: as 6.x writes it, the Normalize as the releases
# just before 6.0 wrote it (it moved in 6.0), and the sentence_transformers.models.* of older
# releases, which 6.x still loads (util/deprecated_import.py)
_MODULE_TYPES = {
    "sentence_transformers.base.modules.transformer.Transformer": "Transformer",
    "sentence_transformers.models.Transformer": "Transformer",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": "Pooling",
    "sentence_transformers.models.Pooling": "Pooling",
    "sentence_transformers.base.modules.normalize.Normalize": "Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize": "Normalize",
    "sentence_transformers.models.Normalize": "Normalize",
}
_PIPELINE = ("Transformer", "Pooling", "Normalize")  # the modules computed, in order; Normalize optional

# The legacy switches, one per pooling mode, in sentence-transformers' order
# (sentence_transformer/modules/pooling.py, _LEGACY_POOLING_MODE_KWARGS). It reads them only when
# pooling_mode is absent; none switched on means mean.
_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

# the Transformer's inputs and output when sentence-transformers embeds plain text: its default
# for feature-extraction, and what it assumes for a checkpoint saved before modality_config existed
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}

# the `message` modality's entry as sentence-transformers 6 saves it; its `format` (how a message's
# content is written) is one of MESSAGE_FORMATS ("auto" is resolved when it saves)
_MESSAGE = {"method": "forward", "method_output_name": "last_hidden_state"}
MESSAGE_FORMATS = ("flat", "structured")
# processing_kwargs' chat_template arguments computed: sentence-transformers' own flag and the
# arguments of apply_chat_template that change what is rendered; any other is computed when it is
# a variable of the template (enable_thinking, ...), else refused
_CHAT_ARGUMENTS = {"restore_suffix", "add_generation_prompt"}

# transformers' VERY_LARGE_INTEGER: a tokenizer's model_max_length meaning "no limit"
_NO_LIMIT = int(1e30)


@dataclasses.dataclass(frozen=True)
class _File:
    """One JSON object of the checkpoint, as the inventory's `accepts` sees it."""

    name: str  # its path in the checkpoint, as messages name it
    raw: Mapping[str, Any]
    hidden_size: int


def _table(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


def _is(expected: Any) -> Callable[[Any, _File], bool]:
    return lambda v, file: v == expected


def _absent(v: Any, file: _File) -> bool:
    return v is None


def _hidden_size(v: Any, file: _File) -> bool:
    return v == file.hidden_size


def _one_mode(v: Any, file: _File) -> bool:
    if isinstance(v, list) and len(v) == 1:  # a one-mode list is that mode (Pooling.__init__)
        v = v[0]
    return isinstance(v, str) and v in MODES


def _legacy_mode(key: str, mode: str) -> Field:
    computed = mode in MODES
    return Field(
        key,
        LIMITED,
        f"switches {mode} pooling on when pooling_mode is absent; "
        + ("computed" if computed else f"{mode} pooling is not computed (one of {', '.join(MODES)} is)"),
        accepts=lambda v, file: computed or not v or "pooling_mode" in file.raw,
    )


def _prompts(raw: Mapping[str, Any]) -> dict[str, str]:
    """The prompts as sentence-transformers holds them: its two defaults, the saved ones over them,
    a saved null read as ""."""
    saved = raw.get("prompts")
    saved = saved if isinstance(saved, dict) else {}  # otherwise refused by the prompts field
    return {**_DEFAULT_PROMPTS, **{name: text or "" for name, text in saved.items()}}


def _prompts_ok(v: Any, file: _File) -> bool:
    return isinstance(v, dict) and all(isinstance(text, (str, type(None))) for text in v.values())


def _positive_int(v: Any, file: _File) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0)


# a modules.json entry
MODULE_KEYS = _table(
    Field("idx", INERT, "the module's position, which sentence-transformers takes from the list's order"),
    Field("name", INERT, "the module's name within the pipeline"),
    Field("type", COMPUTED, "the module's class: Transformer, Pooling and Normalize are computed"),
    Field("path", COMPUTED, "the folder of the module's files"),
    Field(
        "kwargs",
        LIMITED,
        "encode() arguments handed to the module (a Router's task); none is computed",
        accepts=lambda v, file: not v,
    ),
)

# the Pooling's config.json
POOLING_KEYS = _table(
    Field(
        "embedding_dimension",
        LIMITED,
        "the width pooled: it must be the decoder's hidden size, the width of the states pooled",
        accepts=_hidden_size,
    ),
    Field(
        "word_embedding_dimension",
        LIMITED,
        "embedding_dimension's legacy name (read when embedding_dimension is absent); it must be the "
        "decoder's hidden size",
        accepts=lambda v, file: "embedding_dimension" in file.raw or v == file.hidden_size,
    ),
    Field(
        "pooling_mode",
        LIMITED,
        f"how the hidden states are pooled: one of {', '.join(MODES)} is computed (max, mean_sqrt_len_tokens, "
        "weightedmean and a combination of modes are not)",
        accepts=_one_mode,
    ),
    Field(
        "include_prompt",
        LIMITED,
        "whether the prompt's tokens are pooled (true or false)",
        accepts=lambda v, file: isinstance(v, bool),
    ),
    *(_legacy_mode(key, mode) for key, mode in _LEGACY_MODES.items()),
)

# config_sentence_transformers.json
SENTENCE_TRANSFORMERS_KEYS = _table(
    Field("__version__", INERT, "the versions of the libraries that saved the checkpoint"),
    Field(
        "requirements",
        INERT,
        "the library versions sentence-transformers checks its own environment against before loading",
    ),
    Field(
        "model_type",
        LIMITED,
        "the model class: a SentenceTransformer embeds (SparseEncoder, MultiVectorEncoder and CrossEncoder "
        "compute other outputs)",
        accepts=_is("SentenceTransformer"),
    ),
    Field("prompts", LIMITED, "named prompts, each a text prepended to an input (or null: none)", accepts=_prompts_ok),
    Field(
        "default_prompt_name",
        LIMITED,
        "the prompt used when a request names none: null, or the name of one of the prompts",
        accepts=lambda v, file: v is None or (isinstance(v, str) and v in _prompts(file.raw)),
    ),
    Field(
        "similarity_fn_name",
        LIMITED,
        f"how two embeddings compare: one of {', '.join(SIMILARITIES)} (null: cosine)",
        accepts=lambda v, file: v is None or v in SIMILARITIES,
    ),
    Field(
        "truncate_dim",
        LIMITED,
        "cuts each embedding to its first values after the pipeline (so past a Normalize); not computed",
        accepts=_absent,
    ),
)

# sentence_bert_config.json, the Transformer module's configuration
SENTENCE_BERT_KEYS = _table(
    Field(
        "max_seq_length",
        LIMITED,
        "inputs longer than this many tokens are truncated: a positive integer",
        accepts=_positive_int,
    ),
    Field(
        "do_lower_case",
        LIMITED,
        "lowercases every input before it is tokenized; not computed (false is)",
        accepts=lambda v, file: not v,
    ),
    Field(
        "transformer_task",
        LIMITED,
        "the transformers model class loaded: feature-extraction (the base model's hidden states) is computed",
        accepts=_is("feature-extraction"),
    ),
    Field(
        "modality_config",
        LIMITED,
        f"how each kind of input reaches the model: text ({_TEXT_ONLY['text']}) and message ({_MESSAGE} with a "
        f"format of {', '.join(MESSAGE_FORMATS)}; saved when the tokenizer has a chat template: every text is "
        "rendered through the chat template, its prompt as a system message) are computed",
        accepts=lambda v, file: _modalities_ok(v),
    ),
    Field(
        "module_output_name",
        LIMITED,
        "the feature the Transformer writes: token_embeddings, the states the Pooling pools",
        accepts=_is("token_embeddings"),
    ),
    Field(
        "processing_kwargs",
        LIMITED,
        "arguments for the tokenizer or the chat template: the chat_template entry's are computed ("
        f"{', '.join(sorted(_CHAT_ARGUMENTS))}, and the template's own variables, checked when it is read)",
        accepts=lambda v, file: not v or (isinstance(v, dict) and set(v) == {"chat_template"} and _chat_ok(v)),
    ),
    Field(
        "unpad_inputs",
        INERT,
        "whether sentence-transformers packs a batch's sequences into one for flash attention: the same embeddings",
    ),
    Field("query_length", LIMITED, "a multi-vector model's query length; not computed", accepts=_absent),
    Field("document_length", LIMITED, "a multi-vector model's document length; not computed", accepts=_absent),
    Field("query_expansion", LIMITED, "a multi-vector model's query expansion; not computed", accepts=_absent),
)

# the Normalize's config.json (older releases saved none: the defaults)
NORMALIZE_KEYS = _table(
    Field(
        "module_input_name",
        LIMITED,
        "the feature normalized: sentence_embedding, the pooled embedding (another leaves the embedding as pooled)",
        accepts=_is("sentence_embedding"),
    ),
    Field(
        "module_output_name",
        LIMITED,
        "the feature written: sentence_embedding (null: module_input_name's)",
        accepts=lambda v, file: v in (None, "sentence_embedding"),
    ),
)


def _modalities_ok(v: Any) -> bool:
    if not isinstance(v, dict) or not v or not set(v) <= {"text", "message"}:
        return False
    message = v.get("message")
    return v.get("text", _TEXT_ONLY["text"]) == _TEXT_ONLY["text"] and (
        message is None
        or (
            isinstance(message, dict)
            and {k: message.get(k) for k in _MESSAGE} == _MESSAGE
            and set(message) <= {*_MESSAGE, "format"}
            and message.get("format", "flat") in MESSAGE_FORMATS
        )
    )


def _chat_ok(v: dict) -> bool:
    arguments = v["chat_template"]
    return isinstance(arguments, dict) and all(
        isinstance(value, bool) for key, value in arguments.items() if key in _CHAT_ARGUMENTS
    )


def _chat_template(root: Path) -> str | None:
    """The tokenizer's chat template, where transformers reads it: chat_template.jinja, else
    tokenizer_config.json's chat_template."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    tokenizer = _json(root, "tokenizer_config.json")
    template = tokenizer.get("chat_template") if isinstance(tokenizer, dict) else None
    return template if isinstance(template, str) else None


def _chat_inputs(root: Path, sentence_bert: _File | None) -> ChatInputs | None:
    """The `message` modality of sentence_bert_config.json (None: texts as they are), its
    arguments checked against the chat template they are given to."""
    raw = sentence_bert.raw if sentence_bert is not None else {}
    message = (raw.get("modality_config") or {}).get("message")
    if message is None:
        return None
    where = "sentence_bert_config.json modality_config"
    template = _chat_template(root)
    if template is None:
        raise SentenceConfigError(f"{where} renders texts through the chat template, but the tokenizer has none")
    variables = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    if "task" in variables:
        # sentence-transformers gives it only to encode_query / encode_document, which a request does not name
        raise SentenceConfigError(
            f"{where}: the chat template reads a `task` variable (query or document), which is not computed"
        )
    arguments = dict((raw.get("processing_kwargs") or {}).get("chat_template", {}))
    unknown = sorted(set(arguments) - _CHAT_ARGUMENTS - variables)
    if unknown:
        raise SentenceConfigError(
            f"sentence_bert_config.json processing_kwargs chat_template {unknown} are neither arguments computed "
            f"({', '.join(sorted(_CHAT_ARGUMENTS))}) nor variables of the chat template"
        )
    restore = arguments.pop("restore_suffix", True)
    return ChatInputs(message.get("format", "flat"), types.MappingProxyType(arguments), restore)


def _json(root: Path, name: str) -> Any:
    """The parsed file, or None when the checkpoint has none."""
    path = root / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SentenceConfigError(f"{name} is not valid JSON: {e}") from e


def _object(root: Path, name: str, hidden_size: int) -> _File | None:
    raw = _json(root, name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SentenceConfigError(f"{name} is not a JSON object")
    return _File(name, raw, hidden_size)


def _checked(file: _File, inventory: Mapping[str, Field]) -> None:
    """Refuses a key missing from the inventory, or a value it does not compute, naming both."""
    unknown = [key for key in file.raw if key not in inventory]
    if unknown:
        raise SentenceConfigError(
            f"{file.name} keys {unknown} are not in prefixscore's inventory (model/sentence_config.py): "
            "whether they change the embedding is unknown"
        )
    for key, field in inventory.items():  # the inventory's order: prompts before default_prompt_name
        if key in file.raw:
            refusal = field.refusal(file.raw[key], file)
            if refusal:
                raise SentenceConfigError(f"{file.name} {refusal}")


def _pipeline(root: Path) -> tuple[str, str | None]:
    """The Pooling's folder and the Normalize's (None: no Normalize); refuses any other pipeline."""
    modules = _json(root, "modules.json")
    if not isinstance(modules, list):
        raise SentenceConfigError("modules.json is not a JSON list of modules")
    paths: list[str] = []
    for i, entry in enumerate(modules):
        if not isinstance(entry, dict):
            raise SentenceConfigError(f"modules.json: module {i} is not a JSON object")
        _checked(_File(f"modules.json: module {i}", entry, 0), MODULE_KEYS)
        for key in ("type", "path"):
            if not isinstance(entry.get(key), str):
                raise SentenceConfigError(f"modules.json: module {i} has no {key}")
        path = entry["path"]
        where = f"modules.json: module {i} ({entry['type']} at {path or 'the checkpoint root'})"
        kind = _MODULE_TYPES.get(entry["type"])
        if i >= len(_PIPELINE) or kind != _PIPELINE[i]:
            raise SentenceConfigError(
                f"{where} is not supported: only Transformer, then Pooling, then optionally Normalize is computed"
            )
        if kind == "Transformer" and path != "":
            raise SentenceConfigError(
                f'{where} is not supported: the Transformer must be the checkpoint root (path ""), '
                "the decoder prefixscore loads"
            )
        folder = PurePosixPath(path)
        if folder.is_absolute() or ".." in folder.parts or "\\" in path:  # as sentence-transformers refuses
            raise SentenceConfigError(f"{where}: its path leaves the checkpoint")
        paths.append(path)
    if len(paths) < 2:
        raise SentenceConfigError("modules.json has no Pooling after the Transformer: the embedding is undefined")
    return paths[1], paths[2] if len(paths) > 2 else None


def _mode(pooling: _File) -> str:
    """The pooling mode, from pooling_mode or else the legacy switches, as sentence-transformers
    reads them (_convert_legacy_pooling_kwargs); the inventory has refused modes not computed."""
    if "pooling_mode" in pooling.raw:
        mode = pooling.raw["pooling_mode"]
        return mode if isinstance(mode, str) else mode[0]
    on = [key for key in _LEGACY_MODES if pooling.raw.get(key)]
    if len(on) > 1:  # sentence-transformers concatenates the poolings: a wider embedding
        raise SentenceConfigError(
            f"{pooling.name} {', '.join(f'{key}={pooling.raw[key]!r}' for key in on)} is not supported: "
            f"a combination of pooling modes is not computed (one of {', '.join(MODES)} is)"
        )
    return _LEGACY_MODES[on[0]] if on else "mean"


def _max_seq_length(root: Path, sentence_bert: _File | None) -> int | None:
    """sentence_bert_config.json's max_seq_length; else the tokenizer's model_max_length, where
    sentence-transformers 6.2 saves it (and reads it back, capped at the model's positions)."""
    if sentence_bert is not None and sentence_bert.raw.get("max_seq_length") is not None:
        return sentence_bert.raw["max_seq_length"]
    tokenizer = _json(root, "tokenizer_config.json")
    limit = tokenizer.get("model_max_length") if isinstance(tokenizer, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < _NO_LIMIT else None


def read_pooling(path: Path, hidden_size: int) -> Pooling | None:
    """The embedding configuration of the sentence-transformers checkpoint at `path`, whose
    decoder's hidden size is `hidden_size`; None when it has no modules.json (a plain checkpoint).
    Raises SentenceConfigError naming the module, or the file, key and value, it cannot compute."""
    root = Path(path)
    if not (root / "modules.json").is_file():
        return None
    pooling_dir, normalize_dir = _pipeline(root)

    pooling_name = (PurePosixPath(pooling_dir) / "config.json").as_posix()
    pooling = _object(root, pooling_name, hidden_size)
    if pooling is None:
        raise SentenceConfigError(f"{pooling_name} is missing: the Pooling's width and mode are unknown")
    _checked(pooling, POOLING_KEYS)
    dimension = pooling.raw.get("embedding_dimension", pooling.raw.get("word_embedding_dimension"))
    if dimension is None:
        raise SentenceConfigError(f"{pooling_name} has no embedding_dimension")
    mode = _mode(pooling)

    if normalize_dir is not None:
        normalize = _object(root, (PurePosixPath(normalize_dir) / "config.json").as_posix(), hidden_size)
        if normalize is not None:
            _checked(normalize, NORMALIZE_KEYS)

    sentence_bert = _object(root, "sentence_bert_config.json", hidden_size)
    if sentence_bert is not None:
        _checked(sentence_bert, SENTENCE_BERT_KEYS)

    # the oldest checkpoints have none: the defaults
    model = _object(root, "config_sentence_transformers.json", hidden_size)
    if model is not None:
        _checked(model, SENTENCE_TRANSFORMERS_KEYS)
    raw = model.raw if model is not None else {}
    chat = _chat_inputs(root, sentence_bert)
    return Pooling(
        mode=mode,
        # a rendered input's prompt is pooled whatever the Pooling says: sentence-transformers 6.2 does
        # not take it out of a message's pool (it keeps no prompt length for messages)
        include_prompt=pooling.raw.get("include_prompt", True) or chat is not None,
        normalize=normalize_dir is not None,
        dimension=dimension,
        prompts=types.MappingProxyType(_prompts(raw)),
        default_prompt_name=raw.get("default_prompt_name"),
        similarity=raw.get("similarity_fn_name") or "cosine",
        max_seq_length=_max_seq_length(root, sentence_bert),
        chat=chat,
    )


def plain_pooling(mode: str, hidden_size: int) -> Pooling:
    """The embedding of a plain causal LM served with --pooling `mode` ("last" or "mean"): L2
    normalized, as Qwen3-Embedding and e5-mistral are, with empty prompts and cosine similarity."""
    if mode not in PLAIN_MODES:
        raise SentenceConfigError(f"--pooling {mode!r} is not supported: one of {', '.join(PLAIN_MODES)}")
    return Pooling(
        mode=PLAIN_MODES[mode],
        include_prompt=True,
        normalize=True,
        dimension=hidden_size,
        prompts=types.MappingProxyType(dict(_DEFAULT_PROMPTS)),
        default_prompt_name=None,
        similarity="cosine",
        max_seq_length=None,
    )
