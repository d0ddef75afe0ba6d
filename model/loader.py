"""Resolve a model name (preset, local HF directory, .gguf file, hub id) into config, weights and tokenizer."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from prefixscore.choices import AUTO, DEFAULT_DTYPE
from prefixscore.model import presets, weights_cache
from prefixscore.model.config import DTYPES, ModelConfig, load_config
from prefixscore.model.gguf_loader import load_gguf
from prefixscore.model.quant import NONE
from prefixscore.model.quant_choice import ProjectionConverter, QuantizeChoice
from prefixscore.model.sentence_config import Pooling, plain_pooling, read_pooling
from prefixscore.model.tokenizer import TextTokenizer, has_tokenizer_files, load_tokenizer
from prefixscore.model.weights import (
    Place,
    Weights,
    load_safetensors,
    on_default_device,
    on_host,
    place_all,
    quantization_of,
    quantized_at_load,
    random_params,
    with_activation_scheme,
)

log = logging.getLogger("prefixscore.model")

# given the model's config, where each weight goes (a mesh's Layout.place); None: one device
PlaceFor = Callable[[ModelConfig], Place]


@dataclasses.dataclass
class LoadedModel:
    name: str
    cfg: ModelConfig
    params: Weights
    tokenizer: TextTokenizer | None  # None: token-id inputs only
    dtype: str
    # what is 8-bit and how it is multiplied (weights.quantization_of); {"weights": "none"}: nothing
    quantization: dict[str, object] = dataclasses.field(default_factory=lambda: {"weights": NONE})
    # config.json's _name_or_path and architectures[0] (a reranker template is recognized by them:
    # engine/requests/template_choice.py); "" for presets and GGUF files
    name_or_path: str = ""
    architecture: str = ""
    # how it embeds (modules.json's Pooling, or --pooling); None: it serves no embeddings
    pooling: Pooling | None = None


def _dtype(dtype: str) -> jnp.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose from {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    model: str,
    dtype: str = DEFAULT_DTYPE,
    place_for: PlaceFor | None = None,
    quantize: QuantizeChoice | None = None,
    pooling: str = AUTO,
) -> LoadedModel:
    """Load `model`: a preset name, a local directory, a .gguf file, or a hub id (downloads only then).

    place_for(cfg): where each weight goes once read (a mesh sends each device its slice, so
    a model larger than one device loads); None: whole on the default device.
    quantize: what the projections become (model/quant_choice.py; None: as published).
    pooling: its embeddings: a sentence-transformers checkpoint's own Pooling (auto), or a plain
    model's hidden states pooled as `last` or `mean` (model/sentence_config.py)."""
    loaded = _load(model, dtype, place_for, quantize)
    if pooling != AUTO:
        if loaded.pooling is not None:
            raise ValueError(
                f"pooling: {model} is a sentence-transformers checkpoint whose modules.json says how it "
                f"pools; serve it with --pooling auto, not {pooling}"
            )
        loaded.pooling = plain_pooling(pooling, loaded.cfg.hidden_size)
    return loaded


def _load(model: str, dtype: str, place_for: PlaceFor | None, quantize: QuantizeChoice | None) -> LoadedModel:
    jdtype = _dtype(dtype)
    choice = quantize or QuantizeChoice()
    where = place_for or (lambda cfg: on_default_device)
    if model in presets.RANDOM_PRESETS:
        cfg, tok_source = presets.RANDOM_PRESETS[model]
        choice.check_checkpoint(checkpoint_8bit=False)
        tokenizer = load_tokenizer(presets.smollm2_tokenizer_dir()) if tok_source == "smollm2" else None
        params = random_params(cfg, presets.RANDOM_SEED, jdtype)  # test models: built whole, then placed
        if choice.at_load:
            params = quantized_at_load(params, choice.at_load)
        return _loaded(model, cfg, params, tokenizer, dtype, choice, NONE, where)
    if model == "smollm2-135m":
        gguf = presets.smollm2_gguf_path()
        cfg, params = _converted_gguf(gguf, dtype, choice)
        tokenizer = load_tokenizer(presets.smollm2_tokenizer_dir())
        return _loaded(model, dataclasses.replace(cfg, name=model), params, tokenizer, dtype, choice, NONE, where)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model: GGUF file {path} does not exist")
        cfg, params = _converted_gguf(path, dtype, choice)
        return _loaded(path.stem, cfg, params, _gguf_tokenizer(path), dtype, choice, NONE, where)
    if path.is_dir():
        return _load_dir(path, path.name, dtype, where, choice)
    if "/" in model and not model.startswith((".", "/")) and model.count("/") == 1:
        return _load_dir(_hub_snapshot(model), model, dtype, where, choice)
    raise ValueError(
        f"model {model!r} is not a preset ({', '.join(presets.PRESETS)}), a directory, a .gguf file or a hub id"
    )


def _converted_gguf(path: Path, dtype: str, choice: QuantizeChoice) -> tuple[ModelConfig, Weights]:
    """A GGUF file converted on the host (and cached there under the dtype and the choice), to be placed."""
    convert = ProjectionConverter(choice)

    def conversion() -> tuple[ModelConfig, Weights]:
        cfg, params = load_gguf(path, _dtype(dtype), on_host, convert)
        if convert.became:
            log.info("gguf projections of %s: %s", path.name, convert.summary())
        return cfg, params

    return weights_cache.cached(path, f"{dtype}/quantize={choice.quantize}", conversion)


def _loaded(
    name: str,
    cfg: ModelConfig,
    params: Weights,
    tokenizer: TextTokenizer | None,
    dtype: str,
    choice: QuantizeChoice,
    checkpoint_activations: str,
    where: PlaceFor,
) -> LoadedModel:
    """The model with its activation scheme chosen, placed (weights already placed stay)."""
    params = with_activation_scheme(params, choice.activations_for(checkpoint_activations))
    return LoadedModel(name, cfg, place_all(params, where(cfg)), tokenizer, dtype, quantization_of(params))


def _load_dir(path: Path, name: str, dtype: str, place_for: PlaceFor, choice: QuantizeChoice) -> LoadedModel:
    cfg = dataclasses.replace(load_config(path), name=name)
    choice.check_checkpoint(checkpoint_8bit=bool(cfg.quant_weights))
    convert = ProjectionConverter(choice)
    params = load_safetensors(path, cfg, _dtype(dtype), place_for(cfg), convert)
    if convert.became:
        log.info("projections of %s: %s", name, convert.summary())
    tokenizer = load_tokenizer(path) if has_tokenizer_files(path) else None
    loaded = _loaded(name, cfg, params, tokenizer, dtype, choice, cfg.quant_activations or NONE, lambda c: _kept)
    raw = json.loads((path / "config.json").read_text())
    loaded.name_or_path = str(raw.get("_name_or_path") or "")
    loaded.architecture = str((raw.get("architectures") or [""])[0])
    loaded.pooling = read_pooling(path, cfg.hidden_size)
    return loaded


def _kept(name: str, array):
    """Weights already on their devices (placed as they were read) stay where they are."""
    return array


def _gguf_tokenizer(path: Path) -> TextTokenizer | None:
    try:
        return load_tokenizer(path.parent, gguf_file=path.name)
    except Exception:  # a GGUF without tokenizer metadata still scores token ids
        return None


def _hub_snapshot(repo_id: str) -> Path:
    """Download (or reuse the local cache of) a hub checkpoint; the user asked for it by name."""
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=[
                    "config.json",
                    "*.safetensors",
                    "*.safetensors.index.json",
                    "tokenizer*",
                    "vocab*",
                    "merges*",
                    "special_tokens_map.json",
                ],
                local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1",
            )
        )
    except Exception as err:
        raise FileNotFoundError(
            f"model: hub id {repo_id!r} could not be fetched ({type(err).__name__}); the hub is unreachable "
            "or the id is wrong. Pass a local directory, a .gguf file, or a preset instead."
        ) from err
