"""Reranker prompts as data: one `TemplateRecord` per model family, and its binding to a tokenizer.

A template turns a rerank request into an ordinary score request. Everything up to the
document (system turn, instruction, query) is the shared prefix, so its KV is computed once
per query and cached; the document plus the template's suffix is the item. The relevance of a
document is read from the next-token logits after the whole prompt, by the record's formula.

A record states its prompt the way its reference code builds it: a list of pieces, each
tokenized on its own and the ids concatenated (FlagEmbedding's and mixedbread's code tokenize
the query, the separator, the passage and the task prompt apart; Qwen3-Reranker's model card its
system turn, its user turn and its assistant turn). Pieces hold `{query}`, `{instruction}` and
(the document's own piece) `{document}`; a piece without them is tokenized once. The split
between prefix and item falls at the document's piece. Qwen3-Reranker's user turn holds the
query and the document in one piece: the prefix ends with "<Document>:" and the item starts
with " " + document, so a word-initial BPE token (" Paris") stays whole as in the joined piece
(`check_tokenization` reports a document where it would not).

Which record serves a model is chosen at start-up (engine/requests/template_choice.py: `--template auto`
recognizes a published reranker from its checkpoint; README, "Reranker templates").
"""

from __future__ import annotations

import dataclasses
import enum
import re

import numpy as np

from prefixscore import choices
from prefixscore.model.tokenizer import TextTokenizer


class Relevance(enum.Enum):
    """A record's relevance formula over its label tokens' next-token logits."""

    # p(labels[0]) / (p(labels[0]) + p(labels[1])): the softmax over the two label logits
    LABEL_RATIO = "p(labels[0]) / (p(labels[0]) + p(labels[1]))"
    # sigmoid(logit(labels[0]) - logit(labels[1])): the same number as LABEL_RATIO, the way a
    # reference writes it (a difference of two logits)
    LOGIT_DIFFERENCE = "sigmoid(logit(labels[0]) - logit(labels[1]))"
    # sigmoid(logit(labels[0])): one label's raw logit, squashed into [0, 1]
    LOGIT_SIGMOID = "sigmoid(logit(labels[0]))"


@dataclasses.dataclass(frozen=True)
class Recognition:
    """How `--template auto` recognizes a checkpoint of a record's family (template_choice.py).
    The name is required; the rest must then agree, or nothing is chosen."""

    name: str  # a regular expression searched (case-insensitive) in the model's names
    families: tuple[str, ...]  # decoders (model/config.py `family`) the published checkpoints are
    special_tokens: tuple[str, ...] = ()  # added tokens the prompt needs whole (e.g. ChatML's)
    start_token: bool = False  # the reference puts the tokenizer's BOS first: it must add one
    chat_template_mark: str = ""  # a chat template, where the tokenizer has one, contains this


@dataclasses.dataclass(frozen=True)
class TemplateRecord:
    """One reranker prompt: its text around the query and the document, its labels and formula."""

    name: str
    source: str  # where the prompt and the formula are published
    prefix: tuple[str, ...]  # pieces before the document ({query}, {instruction})
    document: str  # the document's own piece ({document})
    suffix: tuple[str, ...]  # pieces after the document ({instruction} too)
    labels: tuple[str, ...]  # label strings, one token each
    relevance: Relevance
    # how an instruction is written into {instruction}; None: the prompt takes no instruction
    instruction: str | None = None
    # the instruction when a request gives none (None: {instruction} is then empty)
    default_instruction: str | None = None
    # the model's own chat template renders system + user turn (prefix, document, suffix are the
    # user message's pieces) and opens the assistant turn
    chat: bool = False
    recognition: Recognition | None = None  # None: never chosen by `auto`, only by name
    # the client phrases the question in the query and documents (no built-in question to check)
    client_phrased: bool = False

    @property
    def takes_instruction(self) -> bool:
        return self.instruction is not None


AUTO = choices.AUTO
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
QWEN3_PREFIX = f"<|im_start|>system\n{QWEN3_SYSTEM}<|im_end|>\n<|im_start|>user\n"
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_USER = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>:"
BGE_GEMMA_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the query by "
    "providing a prediction of either 'Yes' or 'No'."
)
MXBAI_PREFIX = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n"
)
MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search queries. For each "
    "query-document pair, carefully analyze the semantic relationship between them, then provide your binary "
    "relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"
)
MXBAI_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
CHATML = ("<|im_start|>", "<|im_end|>")

RECORDS: dict[str, TemplateRecord] = {
    r.name: r
    for r in (
        TemplateRecord(
            name="qwen3-reranker",
            source="Qwen/Qwen3-Reranker-0.6B model card (format_instruction, process_inputs, compute_logits)",
            prefix=(QWEN3_PREFIX, QWEN3_USER),
            document=" {document}",
            suffix=(QWEN3_SUFFIX,),
            labels=("yes", "no"),
            relevance=Relevance.LABEL_RATIO,
            instruction="{instruction}",
            default_instruction=QWEN3_INSTRUCTION,
            recognition=Recognition(
                r"qwen3-reranker", ("qwen3",), special_tokens=CHATML, chat_template_mark="<|im_start|>"
            ),
        ),
        TemplateRecord(
            name="bge-reranker-v2-gemma",
            source="FlagEmbedding FlagLLMReranker (BAAI/bge-reranker-v2-gemma model card, get_inputs)",
            prefix=("A: {query}", "\n"),
            document="B: {document}",
            # FlagEmbedding's `prompt` argument: the question after the passage is the instruction
            suffix=("\n", "{instruction}"),
            labels=("Yes",),
            relevance=Relevance.LOGIT_SIGMOID,
            instruction="{instruction}",
            default_instruction=BGE_GEMMA_PROMPT,
            recognition=Recognition(r"bge-reranker-v2-gemma", ("gemma",), start_token=True),
        ),
        TemplateRecord(
            name="mxbai-rerank-v2",
            source="mixedbread-ai mxbai-rerank (mxbai_rerank_v2.py: prepare_inputs, _compute_scores)",
            prefix=(MXBAI_PREFIX, "{instruction}query: {query}", "\n"),
            document="document: {document}",
            suffix=("\n", MXBAI_TASK, MXBAI_SUFFIX),
            labels=("1", "0"),
            relevance=Relevance.LOGIT_DIFFERENCE,
            instruction="instruction: {instruction}\n",
            recognition=Recognition(
                r"mxbai-rerank-(base|large)-v2", ("qwen2",), special_tokens=CHATML, chat_template_mark="<|im_start|>"
            ),
        ),
        TemplateRecord(
            name="chat",
            source="the model's own chat template over Qwen3-Reranker's system line and user turn",
            prefix=(QWEN3_USER,),
            document=" {document}",
            suffix=(),
            labels=("yes", "no"),
            relevance=Relevance.LABEL_RATIO,
            instruction="{instruction}",
            default_instruction=QWEN3_INSTRUCTION,
            chat=True,
        ),
        TemplateRecord(
            name="none",
            source="no prompt: the client phrases the question in the query and the documents",
            prefix=("{query}",),
            document="{document}",
            suffix=(),
            labels=("yes", "no"),
            relevance=Relevance.LABEL_RATIO,
            client_phrased=True,
        ),
    )
}
TEMPLATES = tuple(RECORDS)  # the leaf's choices.TEMPLATES, which the flags offer (tests/test_engine_options.py)
_FIELD = re.compile(r"\{(query|instruction|document)\}")
_DOC_MARK = "\x00prefixscore-document\x00"  # stands in for the document when rendering a chat template


def render(piece: str, **values: str) -> str:
    """A piece with its fields filled in one pass (a query holding "{document}" stays as it is)."""
    return _FIELD.sub(lambda m: values[m.group(1)], piece)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One request's prompt split at the document: prefix + document piece + suffix."""

    prefix: str
    suffix: str
    prefix_ids: list[int]  # each piece tokenized on its own, concatenated
    suffix_ids: list[int]


class RerankTemplate:
    """One record bound to a model's tokenizer; see the module doc."""

    def __init__(self, record: TemplateRecord | str, tokenizer: TextTokenizer) -> None:
        if isinstance(record, str):
            if record not in RECORDS:
                raise ValueError(f"template: {record!r} is not one of {', '.join(TEMPLATES)}")
            record = RECORDS[record]
        self.record = record
        self.name = record.name
        self.tokenizer = tokenizer
        try:
            self.label_ids: tuple[int, ...] = tuple(tokenizer.token_id(label) for label in record.labels)
        except ValueError as err:
            raise ValueError(f"template {self.name}: the model's tokenizer cannot serve its labels: {err}") from err
        if record.chat and not getattr(tokenizer.hf, "chat_template", None):
            raise ValueError(f"template {self.name}: the model's tokenizer has no chat template; name another")
        self._fixed: dict[str, list[int]] = {}  # pieces without fields, tokenized once
        self._suffixes: dict[str, list[int]] = {}  # suffix pieces with fields (an instruction) -> ids
        # kept when a document is cut from the left: the marker its piece opens with ("B: ")
        lead = record.document[: record.document.index("{document}")]
        self.lead_ids: list[int] = tokenizer.encode(lead) if lead.strip() else []

    @property
    def reads_logit(self) -> bool:
        """The relevance is a sigmoid of a label's raw logit (else the softmax over the labels,
        which LABEL_RATIO and LOGIT_DIFFERENCE both are): engine/requests/heads.py for_rerank."""
        return self.record.relevance is Relevance.LOGIT_SIGMOID

    def _cached(self, cache: dict[str, list[int]], text: str) -> list[int]:
        ids = cache.get(text)
        if ids is None:
            if len(cache) >= 64:  # per-request instructions: stay bounded
                cache.clear()
            ids = cache[text] = self.tokenizer.encode(text) if text else []
        return ids

    def _ids(self, pieces: tuple[str, ...], repeats: bool, **values: str) -> tuple[str, list[int]]:
        """The pieces' text and ids. A piece without fields is tokenized once; so is one with
        fields when `repeats` (the suffix's instruction: the same text request after request)."""
        texts = [render(p, **values) for p in pieces]
        ids: list[int] = []
        for piece, text in zip(pieces, texts, strict=True):
            if not _FIELD.search(piece):
                ids += self._cached(self._fixed, text)
            elif repeats:
                ids += self._cached(self._suffixes, text)
            elif text:
                ids += self.tokenizer.encode(text)
        return "".join(texts), ids

    def instruction_text(self, instruction: str | None) -> str:
        """What {instruction} becomes: the request's instruction or the record's default, written
        as the record writes it; "" when there is neither."""
        record = self.record
        chosen = instruction or record.default_instruction
        return render(record.instruction, instruction=chosen) if record.instruction and chosen else ""

    def prompt(self, query: str, instruction: str | None) -> Prompt:
        """The prompt of one request, split at the document."""
        values = {"query": query, "instruction": self.instruction_text(instruction)}
        if self.record.chat:
            return self._chat_prompt(values)
        prefix, prefix_ids = self._ids(self.record.prefix, False, **values)
        suffix, suffix_ids = self._ids(self.record.suffix, True, **values)
        return Prompt(prefix, suffix, prefix_ids, suffix_ids)

    def _chat_prompt(self, values: dict[str, str]) -> Prompt:
        """The model's chat template over the system line and the user message; the rendered text
        before the document is the prefix, after it the suffix, each tokenized whole."""
        record = self.record
        user = "".join(render(p, **values) for p in record.prefix) + render(record.document, document=_DOC_MARK)
        user += "".join(render(p, **values) for p in record.suffix)
        messages = [{"role": "system", "content": QWEN3_SYSTEM}, {"role": "user", "content": user}]
        text = self.tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, _, tail = text.partition(_DOC_MARK)
        before = record.document[: record.document.index("{document}")]
        prefix = head[: len(head) - len(before)] if before and head.endswith(before) else head
        return Prompt(prefix, tail, self.tokenizer.encode(prefix), self._cached(self._suffixes, tail))

    def document_text(self, document: str) -> str:
        """The document's piece (" " + document after "<Document>:", "B: " + document, ...)."""
        return render(self.record.document, document=document)

    @staticmethod
    def relevance(scores: np.ndarray) -> list[float]:
        """[documents, labels] scores of a rerank request (the head already applied the record's
        formula: engine/requests/heads.py) -> each document's relevance."""
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
