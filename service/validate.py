"""The one validation pass every transport shares: gRPC, HTTP and the in-process `Scorer`.

A transport only maps its wire format onto `ScoreInput` / `RerankInput` (plain
Python values, unchecked) and maps the one error type, `InvalidInput`, onto its
own status (gRPC: INVALID_ARGUMENT, also when `too_large`;
HTTP: 400, or 413). Everything else happens here, before any device work:
labels, inputs, limits, truncation, templates and the joined-tokenization
check. The result is a `Validated` request in token ids, ready for the batcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.model.token_rows import TokenRows
from prefixscore.service.requests import InvalidInput, RequestTokenizer, TokenizedRequest, check_labels
from prefixscore.service.templates import RerankTemplate

TRUNCATE = ("none", "end")
QUERY_TRUNCATION = ("none", "left", "right")


@dataclasses.dataclass
class ScoreInput:
    """A score request as a transport received it (SGLang's fields, plus ours)."""

    query: object  # text or token ids
    items: object  # texts or token-id lists
    label_token_ids: Sequence[int] = ()
    labels: Sequence[str] = ()  # label strings, one token each (instead of label_token_ids)
    apply_softmax: bool = False
    item_first: bool = False
    truncate: str = "none"  # an item too long: "none" rejects, "end" keeps its first tokens
    query_truncation: str = "none"  # a query too long: "none" rejects, "left"/"right" drop from that side
    max_query_tokens: int | None = None  # with query_truncation: the most query tokens kept
    check_tokenization: bool = False


@dataclasses.dataclass
class RerankInput:
    """A rerank request (Cohere/Jina/vLLM fields) as a transport received it."""

    query: object
    documents: object  # texts
    instruction: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    max_tokens_per_doc: int | None = None
    truncate: str = "end"  # documents: Cohere's default is to cut long ones
    check_tokenization: bool = False


@dataclasses.dataclass(frozen=True)
class Truncation:
    """What truncation removed: reported in the response's usage."""

    query_tokens: int = 0
    items: tuple[int, ...] = ()  # indices of the items (documents) that were cut
    item_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Validated:
    request: TokenizedRequest
    truncation: Truncation = Truncation()
    joined_differs: list[bool] | None = None  # with check_tokenization: per item


@dataclasses.dataclass(frozen=True)
class ValidatedRerank:
    scored: Validated
    documents: list[str]
    top_n: int | None


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """A validated stream open. prefix: start tokens + query (empty for item_first)."""

    query: list[int]
    kind: str  # "text" or "ids": every batch's items must be the same
    label_ids: tuple[int, ...]
    apply_softmax: bool
    item_first: bool
    prefix: tuple[int, ...]


def _choice(field: str, value: object, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InvalidInput(field, f"{value!r} is not one of {', '.join(allowed)}")
    return str(value)


def _count(field: str, value: object) -> int | None:
    """An optional non-negative integer option (0 and None mean unset)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(field, f"must be a non-negative integer, got {value!r}")
    return value or None


class Validator:
    """Validates and tokenizes requests for one model (and its reranker template, if any)."""

    def __init__(self, requests: RequestTokenizer, template: RerankTemplate | None = None) -> None:
        self.requests = requests
        self.template = template
        self.max_sequence_tokens = requests.max_sequence_tokens
        self.max_item_tokens = requests.max_item_tokens

    # ---- pieces ----------------------------------------------------------------------------------
    def labels(self, ids: Sequence[int], labels: Sequence[str]) -> tuple[int, ...]:
        """label_token_ids, or label strings resolved to single tokens; checked against the vocabulary."""
        limits = self.requests.limits
        if ids and labels:
            raise InvalidInput("labels", "set either label_token_ids or labels, not both")
        if labels:
            tokenizer = self.requests.tokenizer
            if tokenizer is None:
                raise InvalidInput("labels", "the model has no tokenizer; send label_token_ids instead")
            if len(labels) > limits.max_labels:
                raise InvalidInput("labels", f"{len(labels)} labels exceed the limit of {limits.max_labels}")
            resolved = []
            for j, label in enumerate(labels):
                try:
                    resolved.append(tokenizer.token_id(label))
                except ValueError as err:
                    raise InvalidInput(f"labels[{j}]", str(err)) from err
            ids = resolved
        return check_labels(list(ids) if isinstance(ids, (list, tuple)) else ids, self.requests.cfg.vocab_size, limits)

    def _room(self, prefix_tokens: int) -> int:
        """The most tokens one item may have after `prefix_tokens` (start tokens + query)."""
        return min(self.max_item_tokens, self.max_sequence_tokens - prefix_tokens)

    def _cut_query(self, query: list[int], how: str, keep: int | None) -> tuple[list[int], int]:
        if how == "none":
            if keep is not None:
                raise InvalidInput("max_query_tokens", "only applies with query_truncation left or right")
            return query, 0
        # at most `keep` tokens, and always room for a one-token item after the start tokens
        budget = min(keep or 1 << 62, self.max_sequence_tokens - len(self.requests.start_ids) - 1)
        if len(query) <= budget:
            return query, 0
        kept = query[len(query) - budget :] if how == "left" else query[:budget]
        return kept, len(query) - budget

    @staticmethod
    def _cut_items(items: TokenRows, room: int) -> tuple[TokenRows, Truncation]:
        lengths = items.lengths
        cut = np.flatnonzero(lengths > room)
        if not cut.size:
            return items, Truncation()
        dropped = int((lengths[cut] - room).sum())
        return items.map_rows(lambda row: row[:room]), Truncation(items=tuple(cut.tolist()), item_tokens=dropped)

    def _joined_differs(self, pairs: list[tuple[str, str]], separate: list[list[int]]) -> list[bool]:
        """For each (first, second) text pair: does tokenizing first + second as one string differ
        from the ids the server scored apart (`separate`, before truncation)?"""
        tokenizer = self.requests.tokenizer
        assert tokenizer is not None
        joined = tokenizer.encode_many([a + b for a, b in pairs])
        return [j != s for j, s in zip(joined, separate, strict=True)]

    # ---- requests --------------------------------------------------------------------------------
    def score(self, inp: ScoreInput) -> Validated:
        """A score request -> token ids, truncated as asked; raises InvalidInput naming the field."""
        labels = self.labels(inp.label_token_ids, inp.labels)
        truncate = _choice("truncate", inp.truncate, TRUNCATE)
        how = _choice("query_truncation", inp.query_truncation, QUERY_TRUNCATION)
        keep = _count("max_query_tokens", inp.max_query_tokens)
        query = self.requests.query_ids(inp.query, truncating=how != "none")
        is_text = isinstance(inp.query, str)
        items = self.requests.item_ids(inp.items, "text" if is_text else "ids", truncating=truncate == "end")
        if inp.check_tokenization and not is_text:
            raise InvalidInput("check_tokenization", "only applies to text inputs (token ids are not tokenized)")
        joined = None
        if inp.check_tokenization and items:
            texts = list(inp.items)  # type: ignore[call-overload]
            if inp.item_first:
                pairs, separate = [(t, inp.query) for t in texts], [it + query for it in items]
            else:
                pairs, separate = [(inp.query, t) for t in texts], [query + it for it in items]
            joined = self._joined_differs(pairs, separate)  # type: ignore[arg-type]
        query, query_cut = self._cut_query(query, how, keep)
        report = Truncation(query_tokens=query_cut)
        if truncate == "end":
            items, cut = self._cut_items(items, self._room(len(self.requests.start_ids) + len(query)))
            report = dataclasses.replace(cut, query_tokens=query_cut)
        req = self.requests.assemble(query, items, labels, bool(inp.apply_softmax), bool(inp.item_first))
        return Validated(req, report, joined)

    def rerank(self, inp: RerankInput) -> ValidatedRerank:
        """A rerank request -> the template's prompt in token ids (prefix = everything up to the
        document; item = document + suffix), documents cut to fit as asked."""
        template = self.template
        if template is None:
            raise InvalidInput("documents", "the model has no tokenizer, so it has no reranker template")
        if not isinstance(inp.query, str):
            raise InvalidInput("query", "must be text")
        if not isinstance(inp.documents, (list, tuple)) or not all(isinstance(d, str) for d in inp.documents):
            raise InvalidInput("documents", "must be a list of strings")
        for j, doc in enumerate(inp.documents):
            if not doc:
                raise InvalidInput(f"documents[{j}]", "the document is empty")
        if inp.instruction and template.name == "none":
            raise InvalidInput("instruction", "the none template has no instruction; put it in the query")
        truncate = _choice("truncate", inp.truncate, TRUNCATE)
        per_doc = _count("max_tokens_per_doc", inp.max_tokens_per_doc)
        top_n = _count("top_n", inp.top_n)
        if not inp.query:
            raise InvalidInput("query", "the query is empty")
        if len(inp.query) > self.requests.limits.max_text_chars:
            limit = self.requests.limits.max_text_chars
            raise InvalidInput("query", f"text of {len(inp.query)} characters exceeds the limit of {limit}")
        prompt = template.prompt(inp.query, inp.instruction)
        prefix = template.prefix_ids(prompt)
        suffix = template.suffix_ids(prompt.suffix)
        texts = [template.document_text(d) for d in inp.documents]
        cutting = truncate == "end" or per_doc is not None
        docs = self.requests.item_ids(texts, "text", field="documents", truncating=cutting)
        joined = None
        if inp.check_tokenization and docs:
            pairs = [(prompt.prefix, t + prompt.suffix) for t in texts]
            joined = self._joined_differs(pairs, [prefix + d + suffix for d in docs])
        start = len(self.requests.start_ids)
        room = self._room(start + len(prefix)) - len(suffix)
        if room < 1:
            raise InvalidInput("query", f"the prompt is {start + len(prefix)} tokens and leaves no room for a document")
        report = Truncation()
        if per_doc is not None and per_doc < room:
            room, truncate = per_doc, "end"  # an explicit per-document budget always cuts
        if truncate == "end":
            docs, report = self._cut_items(docs, room)
        else:  # name the document, not the assembled item
            over = np.flatnonzero(docs.lengths > room)
            if over.size:
                j = int(over[0])
                raise InvalidInput(
                    f"documents[{j}]", f"{docs.lengths[j]} tokens, over the {room} that fit (truncate none)"
                )
        req = self.requests.assemble(prefix, docs.with_suffix(suffix), template.label_ids, True, False)
        return ValidatedRerank(Validated(req, report, joined), list(inp.documents), top_n)

    def stream_open(self, inp: ScoreInput) -> StreamSpec:
        """A stream's query, labels and options (no items yet)."""
        labels = self.labels(inp.label_token_ids, inp.labels)
        ids = self.requests.query_ids(inp.query)
        # no items yet: this checks the query leaves room for one and gives the prefix
        opened = self.requests.assemble(
            ids, TokenRows.coerce([]), labels, bool(inp.apply_softmax), bool(inp.item_first)
        )
        kind = "text" if isinstance(inp.query, str) else "ids"
        return StreamSpec(ids, kind, labels, opened.apply_softmax, opened.item_first, opened.prefix)

    def stream_batch(self, spec: StreamSpec, items: object) -> TokenizedRequest:
        """One batch of an open stream, over the stream's query."""
        ids = self.requests.item_ids(items, spec.kind)  # type: ignore[arg-type]
        return self.requests.assemble(spec.query, ids, spec.label_ids, spec.apply_softmax, spec.item_first)
