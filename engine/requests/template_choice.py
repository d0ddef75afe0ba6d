"""Which reranker template serves a model: `--template NAME`, or `auto` recognizing a published
reranker from its checkpoint (the records' `Recognition`, engine/requests/templates.py).

A prompt is never guessed. A record is chosen by `auto` only when the model's names (the name
it was loaded by, its directory, config.json's `_name_or_path`) match the record's pattern AND the
checkpoint agrees with the published one: its decoder family, its head (a causal LM, or a one-logit
classifier as vLLM converts these rerankers), the added tokens its prompt needs whole, a BOS the
tokenizer adds where the reference puts one first, and the chat template's fingerprint. A name
that matches with a checkpoint that disagrees chooses nothing and says what disagreed. A model
nothing matches gets no template: rerank is refused (FAILED_PRECONDITION / 400, naming
`--template`) while score and classify serve as ever.
"""

from __future__ import annotations

import dataclasses
import re

from prefixscore.engine.requests.templates import AUTO, RECORDS, TEMPLATES, RerankTemplate, TemplateRecord
from prefixscore.model.head import output_head
from prefixscore.model.loader import LoadedModel
from prefixscore.model.tokenizer import TextTokenizer


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What recognition reads of a loaded model."""

    names: tuple[str, ...]  # the name it was loaded by, config.json's _name_or_path
    family: str  # model/config.py `family`
    architecture: str  # config.json's architectures[0] ("" for presets and GGUF files)
    classifier_rows: int  # a sequence classifier's labels; 0: a causal LM
    tokenizer: TextTokenizer | None

    @classmethod
    def of(cls, loaded: LoadedModel) -> Checkpoint:
        names = tuple(dict.fromkeys(n for n in (loaded.name, loaded.name_or_path) if n))
        head = output_head(loaded.cfg)
        rows = head.rows if head.own_rows else 0
        return cls(names, loaded.cfg.family, loaded.architecture, rows, loaded.tokenizer)


@dataclasses.dataclass(frozen=True)
class TemplateChoice:
    """The chosen template (None: none, rerank is refused) and why, as the model description says it."""

    template: str | None
    reason: str

    def refusal(self) -> str:
        """Rerank's refusal on a model with no template (empty when there is one)."""
        if self.template is not None:
            return ""
        return (
            f"the server has no reranker template: {self.reason}; start it with --template NAME "
            f"(one of {', '.join(TEMPLATES)}) to rerank"
        )


def _disagreement(record: TemplateRecord, ckpt: Checkpoint) -> str:
    """What in the checkpoint differs from the record's published ones ("" if nothing)."""
    rec = record.recognition
    assert rec is not None
    if ckpt.family not in rec.families:
        return f"its decoder is {ckpt.family}, the published checkpoints' is {' or '.join(rec.families)}"
    if ckpt.classifier_rows > 1:
        return f"it is a classifier of {ckpt.classifier_rows} labels (a converted reranker has one)"
    tok = ckpt.tokenizer
    if tok is None:
        return "it has no tokenizer"
    added = {t.content for t in tok.hf.added_tokens_decoder.values()}
    missing = [t for t in rec.special_tokens if t not in added]
    if missing:
        return f"its tokenizer lacks the added tokens {missing}"
    if rec.start_token and not tok.start_ids:
        return "its tokenizer adds no BOS token, which the published prompt starts with"
    chat = getattr(tok.hf, "chat_template", None)
    if rec.chat_template_mark and isinstance(chat, str) and rec.chat_template_mark not in chat:
        return f"its chat template has no {rec.chat_template_mark!r}"
    for label in record.labels:
        if len(tok.encode(label)) != 1:
            return f"its label {label!r} is not one token"
    return ""


def recognize(ckpt: Checkpoint) -> TemplateChoice:
    """`--template auto`: the record whose recognition matches the checkpoint, or none and why."""
    for record in RECORDS.values():
        rec = record.recognition
        if rec is None:
            continue
        named = next((n for n in ckpt.names if re.search(rec.name, n, re.IGNORECASE)), None)
        if named is None:
            continue
        differs = _disagreement(record, ckpt)
        if differs:
            return TemplateChoice(None, f"the name {named!r} is {record.name}'s, but {differs}")
        arch = f" ({ckpt.architecture})" if ckpt.architecture else ""
        head = "a one-logit classifier" if ckpt.classifier_rows else "a causal LM"
        return TemplateChoice(
            record.name, f"recognized: the name {named!r} and {head} of the {ckpt.family} decoder{arch}"
        )
    names = ", ".join(repr(n) for n in ckpt.names) or "none"
    return TemplateChoice(None, f"no published reranker is recognized in this model (names {names})")


def choose(requested: str, ckpt: Checkpoint) -> TemplateChoice:
    """The template `--template requested` serves on this checkpoint."""
    if requested == AUTO:
        return recognize(ckpt)
    if requested not in RECORDS:
        raise ValueError(f"template: {requested!r} is not one of {AUTO}, {', '.join(TEMPLATES)}")
    return TemplateChoice(requested, "named by --template")


def bind(requested: str, loaded: LoadedModel) -> tuple[RerankTemplate | None, TemplateChoice]:
    """The template serving `loaded` (None: none) and the choice that gave it. A model without a
    tokenizer has none (it takes token ids only). A record the tokenizer cannot serve (its labels
    not one token each, no chat template for `chat`) raises ValueError: the start-up fails."""
    if loaded.tokenizer is None:
        return None, TemplateChoice(None, "the model has no tokenizer")
    choice = choose(requested, Checkpoint.of(loaded))
    template = RerankTemplate(choice.template, loaded.tokenizer) if choice.template else None
    return template, choice
