"""The engine's options, each declared once: its name, help, default, type and choices.

Every way of building an engine reads this table: `prefixscore serve` (ServerConfig's fields,
service/config.py, with their PREFIXSCORE_* variables), `bench`, `eval` and `batch` (`add_flags`)
and the keywords of `Scorer.load`; `EngineSpec.from_options` (engine/build.py) is the one mapping
to the engine. A new option is one row here: EngineSpec's and ServerConfig's fields are made
from the rows (`fields_class`), not written again. No JAX is imported: every command line reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from prefixscore import choices


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """One option: `name` is the keyword of Scorer.load, the attribute of parsed arguments, the
    ServerConfig field and (unless `engine_field` is False) the EngineSpec field, both made from
    this row (`fields_class`)."""

    name: str
    help: str
    default: Any
    parse: Callable[[str], Any] = str  # the flag's text -> the value
    choices: tuple[str, ...] | None = None
    flag: str = ""  # the flag without its dashes; "": the name with dashes
    env: str = ""  # serve's environment variable after PREFIXSCORE_; "": the flag in capitals
    engine_field: bool = True  # False: the scorer's (the template), not the engine's

    @property
    def flag_name(self) -> str:
        return "--" + (self.flag or self.name.replace("_", "-"))

    @property
    def annotation(self) -> str:
        """The field's type as an annotation spells it: the parsed value's type, `| None` where
        None is the default (None: unset, the engine chooses)."""
        kind = self.parse.__name__ if isinstance(self.parse, type) else "object"
        return kind if self.default is not None else f"{kind} | None"


OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("model", "preset, local HF directory, .gguf file or hub id", choices.DEFAULT_MODEL),
    EngineOption("dtype", "the weights' and the pool's dtype", choices.DEFAULT_DTYPE, choices=choices.DTYPES),
    EngineOption(
        "quantize",
        "8-bit projections: auto keeps a checkpoint's as published (GGUF blocks, compressed-tensors), none "
        "serves them in --dtype, int8|fp8 quantize every projection per channel at load",
        choices.AUTO,
        choices=choices.QUANTIZE,
    ),
    EngineOption(
        "activations",
        "8-bit activations of 8-bit projections: dynamic per token (W8A8), none (W8A16); auto follows the "
        "checkpoint (dynamic for --quantize int8|fp8)",
        choices.AUTO,
        choices=choices.ACTIVATIONS,
    ),
    EngineOption(
        "template",
        "reranker prompt template of Rerank and /v1/rerank; auto: the published reranker recognized from the "
        "checkpoint, else rerank is refused until one is named",
        choices.DEFAULT_TEMPLATE,
        choices=choices.TEMPLATE_CHOICES,
        engine_field=False,
    ),
    EngineOption(
        "pooling",
        "embeddings (/v1/embeddings): auto serves a sentence-transformers checkpoint's Pooling "
        "(modules.json) and none for other models; last|mean pools a plain model's final hidden "
        "states (the last token's, or their mean), L2-normalized",
        choices.AUTO,
        choices=choices.POOLING,
    ),
    EngineOption(
        "pool_bytes",
        "bytes of the prefix pool on each device (query KV pages, allocated once); default: "
        "--pool-memory-fraction of the device memory left after the weights, or 1 GiB on CPU, "
        "at most 64 full contexts",
        None,
        int,
    ),
    # the engine's POOL_MEMORY_FRACTION (engine/runtime/pool_size.py; tests/test_engine_options.py checks
    # they agree)
    EngineOption("pool_memory_fraction", "share of the free device memory the prefix pool takes", 0.5, float),
    EngineOption(
        "compile_cache",
        "persistent XLA compilation cache directory; 'off' disables (default: ~/.cache/prefixscore/jax)",
        None,
        env="COMPILE_CACHE_DIR",
    ),
    EngineOption(
        "attn_impl",
        "attention implementation (default: the backend's)",
        None,
        choices=choices.ATTENTION,
        flag="attention",
    ),
    # the device mesh (engine/runtime/mesh.py): devices on the model axis (tensor parallel) and the data
    # axis (replicas); None: chosen (the smallest model axis the weights fit, the rest data)
    EngineOption(
        "tp_size",
        "devices on the mesh's model axis (tensor parallel: each holds 1/tp of the heads, MLP, "
        "vocabulary and pool); default: the smallest the weights fit with room for the pool",
        None,
        int,
    ),
    EngineOption("dp_size", "devices on the mesh's data axis (replicas); default: the devices left", None, int),
    # the call shapes (engine/runtime/buckets.py's Buckets, whose defaults the help states)
    EngineOption("max_batch_tokens", "item tokens per device in one call (default 8192)", None, int),
    EngineOption("max_prefill_tokens", "query tokens prefilled in one call (default 4096)", None, int),
)
BY_NAME: dict[str, EngineOption] = {option.name: option for option in OPTIONS}


def fields_class(
    name: str,
    module: str,
    *,
    engine_only: bool = False,
    frozen: bool = False,
    metadata: Callable[[EngineOption], Mapping[str, Any]] | None = None,
) -> type:
    """A dataclass with a field for each option (its name, its type `annotation`, its default), in
    the table's order: the base EngineSpec (engine/build.py) and ServerConfig (service/config.py)
    extend with their other fields, so an option's field is declared once, as its row here.
    `engine_only`: only the engine's options (engine_field); `metadata`: each field's (ServerConfig's
    Flag); `frozen` as the class that extends it (a dataclass cannot mix the two)."""
    fields = [
        (o.name, o.annotation, dataclasses.field(default=o.default, metadata=metadata(o) if metadata else None))
        for o in OPTIONS
        if o.engine_field or not engine_only
    ]
    made = dataclasses.make_dataclass(name, fields, frozen=frozen)
    made.__module__, made.__doc__ = module, "The engine's options (engine/options.py) as fields."
    return made


def add_flags(p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
    """A flag for each option (`bench`, `eval`, `batch`; `serve` takes them as ServerConfig fields);
    `defaults`: a command's own default for some (the bench's model)."""
    defaults = defaults or {}
    for option in OPTIONS:
        default = defaults.get(option.name, option.default)
        p.add_argument(
            option.flag_name,
            dest=option.name,
            type=option.parse,
            choices=option.choices,
            default=default,
            help=option.help + ("" if default is None else " [%(default)s]"),
        )


def values(source: object) -> dict[str, Any]:
    """Each option's value as `source` (parsed arguments, a ServerConfig) holds it: Scorer.load's keywords."""
    return {option.name: getattr(source, option.name) for option in OPTIONS}


def check_names(given: Mapping[str, Any]) -> None:
    """Refuses keywords that are no option (as a misspelt keyword argument would be)."""
    unknown = sorted(set(given) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; the options: {', '.join(BY_NAME)}")
