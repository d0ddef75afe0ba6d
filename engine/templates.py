"""Reranker prompt templates: (query, document) -> a cached prefix and a per-document item.

A template turns a rerank request into an ordinary score request. Everything up
to the document (system line, instruction, query) is the shared prefix, so its
KV is computed once per query and cached; the document plus the template's
suffix (the end of the user turn and the assistant's opening) is the item.
The relevance of a document is read from the next-token distribution after
the whole prompt.

- `qwen3-reranker`: Qwen3-Reranker's published prompt, with labels "yes" and
  "no"; relevance = p(yes) / (p(yes) + p(no)) (a softmax over the two label
  logits, which is exactly that ratio).
- `chat`: the same question rendered with the model's own chat template
  (`tokenizer.apply_chat_template`), for instruction-tuned models that are not
  Qwen3-Reranker; same labels and relevance.
- `none`: no prompt at all. The prefix is the query text, the item is the
  document text, and relevance = p(yes) / (p(yes) + p(no)) of the next token
  after `query + document`. The client phrases the question itself (for
  example a query ending in "... Is this document relevant? Answer yes or no:"
  and documents that end where the answer starts).

The split point is the document's first character: the prefix ends with
"<Document>:" and the item starts with " " + document, so a word-initial
BPE token (" Paris") stays whole, as it would in the joined prompt.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prefixscore.model.tokenizer import TextTokenizer

TEMPLATES = ("qwen3-reranker", "chat", "none")
DEFAULT_TEMPLATE = "qwen3-reranker"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
# Qwen3-Reranker's model card: prefix + "<Instruct>: ...\n<Query>: ...\n<Document>: ..." + suffix
QWEN3_PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
LABELS = ("yes", "no")  # relevance = p(LABELS[0]) / (p(LABELS[0]) + p(LABELS[1]))
_DOC_MARK = "\x00prefixscore-document\x00"  # stands in for the document when rendering a chat template


def user_turn(instruction: str, query: str, document: str) -> str:
    """The user message of Qwen3-Reranker's format."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One rerank prompt split at the document: prefix + document + suffix is the whole text."""

    prefix: str  # shared by every document of a request: the cached prefix
    suffix: str  # appended to every document: part of each item
    fixed: str = ""  # the prefix's opening that every request shares and that ends at an added token


class RerankTemplate:
    """One template bound to a model's tokenizer; see the module doc."""

    def __init__(self, name: str, tokenizer: TextTokenizer) -> None:
        if name not in TEMPLATES:
            raise ValueError(f"template: {name!r} is not one of {', '.join(TEMPLATES)}")
        self.name = name
        self.tokenizer = tokenizer
        try:
            self.label_ids: tuple[int, ...] = tuple(tokenizer.token_id(label) for label in LABELS)
        except ValueError as err:
            raise ValueError(f"template {name}: the model's tokenizer cannot serve the yes/no labels: {err}") from err
        if name == "chat" and not getattr(tokenizer.hf, "chat_template", None):
            raise ValueError("template chat: the model's tokenizer has no chat template; use qwen3-reranker or none")
        self._suffix_ids: dict[str, list[int]] = {}  # suffix text -> ids: one or two per template
        # qwen3-reranker's system turn, up to the user turn's opening special token: tokenized once
        self._fixed = tokenizer.fixed_head(QWEN3_PREFIX) if name == "qwen3-reranker" else ""
        self._fixed_ids = tokenizer.encode(self._fixed) if self._fixed else []

    def suffix_ids(self, suffix: str) -> list[int]:
        """The token ids of a prompt's suffix, tokenized once: every request's is the same text."""
        ids = self._suffix_ids.get(suffix)
        if ids is None:
            if len(self._suffix_ids) >= 16:  # a chat template whose suffix varies: stay bounded
                self._suffix_ids.clear()
            ids = self._suffix_ids[suffix] = self.tokenizer.encode(suffix) if suffix else []
        return ids

    def prompt(self, query: str, instruction: str | None) -> Prompt:
        """The prompt of one request, split at the document."""
        if self.name == "none":
            return Prompt(prefix=query, suffix="")
        instruction = instruction or DEFAULT_INSTRUCTION
        if self.name == "qwen3-reranker":
            prefix = QWEN3_PREFIX + user_turn(instruction, query, "").rstrip(" ")
            return Prompt(prefix=prefix, suffix=QWEN3_SUFFIX, fixed=self._fixed)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user_turn(instruction, query, _DOC_MARK)},
        ]
        text = self.tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, _, after = text.partition(_DOC_MARK)
        return Prompt(prefix=before.rstrip(" "), suffix=after)

    def prefix_ids(self, prompt: Prompt) -> list[int]:
        """The token ids of a prompt's prefix, the same as tokenizing it whole: its fixed opening's
        ids were computed once (see TextTokenizer.fixed_head), only the rest is tokenized."""
        if prompt.fixed and prompt.prefix.startswith(prompt.fixed):
            return self._fixed_ids + self.tokenizer.encode(prompt.prefix[len(prompt.fixed) :])
        return self.tokenizer.encode(prompt.prefix)

    def document_text(self, document: str) -> str:
        """The document as it follows the prefix (a space after "<Document>:" unless `none`)."""
        return document if self.name == "none" else " " + document

    @staticmethod
    def relevance(scores: np.ndarray) -> list[float]:
        """[documents, LABELS] scores (apply_softmax=True) -> each document's relevance,
        p(yes) / (p(yes) + p(no))."""
        return scores[:, 0].tolist() if len(scores) else []


@dataclasses.dataclass(frozen=True)
class Ranked:
    index: int  # the document's index in the request
    relevance_score: float


def ranked(scores: np.ndarray, top_n: int | None = None) -> list[Ranked]:
    """[documents, labels] scores of a template request -> relevance, highest first (ties: lower
    index first, so the order is deterministic), the first `top_n` only when given."""
    relevance = RerankTemplate.relevance(scores)
    order = sorted(range(len(relevance)), key=lambda j: (-relevance[j], j))
    return [Ranked(j, relevance[j]) for j in order[:top_n]]
