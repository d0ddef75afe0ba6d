"""Text -> token ids through `transformers.AutoTokenizer`, from a local directory or a GGUF file.

Query and each item are tokenized separately and their ids concatenated, with
the tokenizer's special start tokens (BOS) only at the very start of the whole
sequence. That makes the query a well-defined shared prefix; it can differ from
tokenizing the concatenated string where a BPE merge would span the boundary.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import prefixscore.model.hf_quiet  # noqa: F401  (before transformers: no torch advisory in the log)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class TextTokenizer:
    """Wraps a HF tokenizer with the separate-tokenization contract above."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        with_special = hf_tokenizer("a", add_special_tokens=True).input_ids
        plain = hf_tokenizer("a", add_special_tokens=False).input_ids
        # the start tokens the tokenizer itself adds (e.g. Llama's BOS); none for Qwen, SmolLM2
        n = len(with_special) - len(plain)
        self.start_ids: list[int] = list(with_special[:n]) if n > 0 and with_special[n:] == plain else []
        # the end tokens it adds after a text (e.g. Qwen3-Embedding's <|endoftext|>): a sequence
        # cut to fit keeps them, as the tokenizer's own truncation does
        lead = len(self.start_ids)
        ends = with_special[lead + len(plain) :]
        self.end_ids: list[int] = list(ends) if with_special[lead : lead + len(plain)] == plain else []
        backend = getattr(hf_tokenizer, "backend_tokenizer", None) if getattr(hf_tokenizer, "is_fast", False) else None
        self._backend = backend if hasattr(backend, "encode_batch_fast") else None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: a text of `c` characters has at
        least `c / max_token_chars` tokens, so a text too long for a limit is refused before the
        (costly) tokenization. A vocabulary entry spells each byte with at least one character;
        the factor 2 covers normalizers that merge characters (NFC/NFKC)."""
        return 2 * max(1, max((len(t) for t in self.hf.get_vocab()), default=1))

    def encode(self, text: str) -> list[int]:
        """Token ids of one piece of text, no special tokens."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens. A fast tokenizer's Rust core is called
        directly (the same ids; the transformers wrapper around it costs more host time than
        the tokenization of a small request itself)."""
        if not texts:
            return []
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=False).input_ids]

    def encode_whole_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with the tokenizer's special tokens, as sentence-transformers
        tokenizes an input (its prompt already prepended to the text)."""
        if not texts:
            return []
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=True)]
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=True).input_ids]

    def encode_whole(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text as the tokenizer itself encodes a prompt (vLLM's /tokenize): with
        its own special tokens when asked (a BOS, or whatever its template adds)."""
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included (vLLM's /detokenize)."""
        return self.hf.decode(list(ids))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (the tokenizer's own spelling, e.g. "Ġthe")."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(ids))]

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded alone: the text it adds (" the" where the vocabulary says "Ġthe"), as
        vLLM names a completion's tokens."""
        return self.hf.batch_decode([[int(t)] for t in ids])

    def info(self, context_length: int) -> dict[str, object]:
        """What a client needs to tokenize as this tokenizer does (vLLM's /tokenizer_info): its
        class, special tokens and chat template."""
        hf = self.hf
        return {
            "tokenizer_class": type(hf).__name__,
            "model_max_length": context_length,
            "bos_token": hf.bos_token,
            "eos_token": hf.eos_token,
            "pad_token": hf.pad_token,
            "unk_token": hf.unk_token,
            "chat_template": getattr(hf, "chat_template", None),
            "add_bos_token": bool(self.start_ids),
        }

    def token_id(self, label: str) -> int:
        """The single token a label string maps to; ValueError if it is not exactly one token."""
        ids = self.encode(label)
        if len(ids) != 1:
            raise ValueError(f"label {label!r} is {len(ids)} tokens ({ids}); a label must be exactly one token")
        return ids[0]

    def save(self, directory: str | Path) -> None:
        self.hf.save_pretrained(str(directory))


def has_tokenizer_files(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path, gguf_file: str | None = None) -> TextTokenizer:
    """Load from a local directory (or a GGUF file inside it); never reaches a hub."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if gguf_file:
        return TextTokenizer(gguf_hf_tokenizer(Path(model_dir) / gguf_file))
    from transformers import AutoTokenizer

    return TextTokenizer(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))


def gguf_hf_tokenizer(path: str | Path):
    """A transformers fast tokenizer from a GGUF file's `tokenizer.*` metadata.

    `AutoTokenizer.from_pretrained(gguf_file=...)` reads the metadata through a
    torch-based reader, so it fails in a serving image without torch. This reads
    the metadata with the `gguf` package and hands it to the same transformers
    converter, so the result is the tokenizer transformers itself would build.
    Raises ValueError if the file carries no tokenizer.
    """
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = GGUFReader(str(path)).fields
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"model: {path} has no tokenizer metadata")
    meta = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to sentencepiece vocabularies by default
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(fields["general.architecture"].contents(), tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
