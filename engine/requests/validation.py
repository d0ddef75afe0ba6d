"""Validation and tokenization shared by every request kind (engine/requests/kind.py), before any
device work: a model's limits, its inputs as token ids (text or ids, checked against the
vocabulary), label tokens, and a request assembled in token ids (`TokenizedRequest`) within the
context and the request limits.

A transport only maps its wire format onto a kind's input (plain Python values, unchecked) and
maps the one error type, `InvalidInput` (which names the offending field), onto its own status
(gRPC: INVALID_ARGUMENT, also when `too_large`; HTTP: 400, or 413). A kind's module validates
what is its own (engine/requests/score.py, rerank.py, classify.py, likelihood.py, completions.py,
embedding.py) with what is here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import chain

import numpy as np

from prefixscore.engine.loop.request import Answer, TokenizedRequest
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.config import ModelConfig
from prefixscore.model.head import output_head
from prefixscore.model.tokenizer import TextTokenizer


@dataclasses.dataclass(frozen=True)
class Limits:
    max_items: int = 10_000
    max_labels: int = 256
    max_text_chars: int = 1_000_000
    # the longest sequence / item the engine's buckets serve (None: the model's context)
    max_sequence_tokens: int | None = None
    max_item_tokens: int | None = None
    # tokens in one request or stream batch (query once, plus every item); None: no limit
    max_request_tokens: int | None = None
    # tokens per page of the prefix pool: /v1/classify shares whole pages of its inputs' prefix
    page_tokens: int = 1

    @classmethod
    def for_engine(cls, engine, **overrides) -> Limits:
        """Limits that keep every request within the engine's largest buckets."""
        b = engine.buckets
        return cls(
            **{
                "max_labels": b.max_labels,
                "max_sequence_tokens": b.context,
                "max_item_tokens": min(b.context, b.tokens[-1]),
                "page_tokens": b.page_tokens,
                **overrides,
            }
        )


def plain_ints(x: Sequence[object]) -> bool:
    """Every element exactly an int (not a bool): one C-level pass, the common case of
    thousands of ids a request (a Python-level loop per id showed in W1's host time)."""
    return set(map(type, x)) <= {int}


def _is_ids(x: object) -> bool:
    return isinstance(x, (list, tuple)) and (
        plain_ints(x) or all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def check_ids(field: str, ids: Sequence[int], vocab: int) -> None:
    if ids and plain_ints(ids) and min(ids) >= 0 and max(ids) < vocab:
        return
    for t in ids:  # the slow path finds and names the offending id
        if not isinstance(t, int) or isinstance(t, bool):
            raise InvalidInput(field, f"token ids must be integers, got {type(t).__name__}")
        if not 0 <= t < vocab:
            raise InvalidInput(field, f"token id {t} is outside the vocabulary [0, {vocab})")


def check_rows(field: str, rows: TokenRows, vocab: int) -> None:
    """Every id of every item inside the vocabulary and no item empty: a few array passes for
    the whole request; the message names the first offending item."""
    flat = rows.flat
    if flat.size and (flat.min() < 0 or flat.max() >= vocab):
        at = int(np.flatnonzero((flat < 0) | (flat >= vocab))[0])
        j = int(np.searchsorted(rows.offsets, at, side="right")) - 1
        raise InvalidInput(f"{field}[{j}]", f"token id {int(flat[at])} is outside the vocabulary [0, {vocab})")
    empty = np.flatnonzero(rows.lengths == 0)
    if empty.size:
        raise InvalidInput(f"{field}[{int(empty[0])}]", "the item is empty (no tokens)")


def check_labels(label_token_ids: Sequence[int], vocab: int, limits: Limits) -> tuple[int, ...]:
    if not isinstance(label_token_ids, (list, tuple)) or not label_token_ids:
        raise InvalidInput("label_token_ids", "at least one label token id is required")
    if len(label_token_ids) > limits.max_labels:
        raise InvalidInput("label_token_ids", f"{len(label_token_ids)} labels exceed the limit of {limits.max_labels}")
    check_ids("label_token_ids", label_token_ids, vocab)
    return tuple(label_token_ids)


class RequestTokenizer:
    """Validates and tokenizes score requests for one model."""

    def __init__(self, cfg: ModelConfig, tokenizer: TextTokenizer | None, limits: Limits | None = None) -> None:
        self.cfg = cfg
        self.head = output_head(cfg)
        self.tokenizer = tokenizer
        self.limits = limits or Limits()
        self.start_ids: list[int] = tokenizer.start_ids if tokenizer else []
        context = cfg.context_length
        # one sequence (start tokens + query + item), and one item, at most
        self.max_sequence_tokens = min(context, self.limits.max_sequence_tokens or context)
        self.max_item_tokens = min(self.max_sequence_tokens, self.limits.max_item_tokens or context)

    def _text(self, field: str, text: str, truncating: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise InvalidInput(field, f"model {self.cfg.name!r} has no tokenizer; send token ids instead of text")
        if len(text) > self.limits.max_text_chars:
            raise InvalidInput(
                field, f"text of {len(text)} characters exceeds the limit of {self.limits.max_text_chars}"
            )
        if not truncating:
            self.check_chars(field, len(text), self.max_sequence_tokens)
        return self.tokenizer.encode(text)

    def check_chars(self, field: str, chars: int, max_tokens: int) -> None:
        """Refuse text that is surely over `max_tokens` from its length alone, before tokenizing it:
        tokenizing megabytes costs seconds of CPU and memory that a refusal should not."""
        assert self.tokenizer is not None
        if chars > max_tokens * self.tokenizer.max_token_chars:
            raise InvalidInput(
                field,
                f"text of {chars} characters is over {max_tokens} tokens (at most "
                f"{self.tokenizer.max_token_chars} characters a token)",
            )

    def check_request_tokens(self, tokens: int) -> None:
        """The request's tokens (query once, plus every item) against max_request_tokens."""
        limit = self.limits.max_request_tokens
        if limit is not None and tokens > limit:
            raise InvalidInput("items", f"the request is {tokens} tokens, over the limit of {limit} per request")

    def query_ids(self, query: str | Sequence[int], truncating: bool = False) -> list[int]:
        if isinstance(query, str):
            if not query:
                raise InvalidInput("query", "the query is empty")
            return self._text("query", query, truncating)
        if not _is_ids(query):
            raise InvalidInput("query", "must be a string or a list of integer token ids")
        if not query:
            raise InvalidInput("query", "the query is empty")
        check_ids("query", query, self.cfg.vocab_size)
        return list(query)

    def item_ids(
        self,
        items: Sequence[str] | Sequence[Sequence[int]],
        kind: str | None = None,
        field: str = "items",
        truncating: bool = False,
    ) -> TokenRows:
        """Tokenize items; `kind` ("text" or "ids") is the query's kind, and items must match it.
        `field`: what errors call the list ("items", or "documents" for a rerank). `truncating`:
        the caller cuts items to fit, so only max_text_chars bounds a text before tokenizing."""
        if not isinstance(items, (list, tuple, TokenRows)):
            raise InvalidInput(field, "must be a list of strings or a list of token-id lists")
        if len(items) > self.limits.max_items:
            limit = self.limits.max_items
            raise InvalidInput(field, f"{len(items)} items exceed the limit of {limit} per request", too_large=True)
        texts = [False] * len(items) if isinstance(items, TokenRows) else [isinstance(it, str) for it in items]
        if any(texts) and not all(texts):
            raise InvalidInput(field, "mixes text and token ids; send all items the same way")
        item_kind = "text" if items and texts[0] else "ids"
        if items and kind is not None and item_kind != kind:
            raise InvalidInput(field, f"items are {item_kind} but the query is {kind}; do not mix text and token ids")
        if item_kind == "text":
            for j, it in enumerate(items):
                if not it:
                    raise InvalidInput(f"{field}[{j}]", "the item is empty")
                if len(it) > self.limits.max_text_chars:
                    raise InvalidInput(
                        f"{field}[{j}]", f"text exceeds the limit of {self.limits.max_text_chars} characters"
                    )
            if self.tokenizer is None:
                raise InvalidInput(field, f"model {self.cfg.name!r} has no tokenizer; send token ids instead of text")
            if not truncating:  # texts that will be cut to fit are not refused for their size
                for j, it in enumerate(items):
                    self.check_chars(f"{field}[{j}]", len(it), self.max_sequence_tokens)
                if self.limits.max_request_tokens is not None:
                    self.check_chars(field, sum(len(it) for it in items), self.limits.max_request_tokens)
            rows = TokenRows.from_lists(self.tokenizer.encode_many(list(items)))  # type: ignore[arg-type]
        elif isinstance(items, TokenRows):  # from the wire: integers by the message's type
            rows = items
        else:
            lists = all(isinstance(it, (list, tuple)) for it in items)
            if not (lists and set(map(type, chain.from_iterable(items))) <= {int}):  # type: ignore[arg-type]
                for j, it in enumerate(items):  # the slow path names the offending item
                    if not _is_ids(it):
                        raise InvalidInput(f"{field}[{j}]", "must be a list of integer token ids")
            rows = TokenRows.from_lists(items)  # type: ignore[arg-type]
        check_rows(field, rows, self.cfg.vocab_size)
        return rows

    def assemble(
        self,
        query: list[int],
        items: TokenRows,
        labels: tuple[int, ...],
        answer: Answer,
        item_first: bool,
    ) -> TokenizedRequest:
        """Place start tokens and check every sequence fits the context (array passes over the items)."""
        context, max_item = self.max_sequence_tokens, self.max_item_tokens
        start = list(self.start_ids)
        if len(start) + len(query) + 1 > context:
            raise InvalidInput(
                "query", f"{len(start) + len(query)} tokens leave no room for an item within {context} tokens"
            )
        lengths = items.lengths
        totals = len(start) + len(query) + lengths
        over = totals > context
        if not item_first:
            over |= lengths > max_item
        if over.any():
            j = int(np.flatnonzero(over)[0])
            if totals[j] > context:
                raise InvalidInput(f"items[{j}]", f"query + item is {totals[j]} tokens, over the limit of {context}")
            raise InvalidInput(f"items[{j}]", f"{lengths[j]} tokens, over the item limit of {max_item}")
        pad = self.head.pad_token_id
        if pad is not None and len(items):  # a classifier: transformers would read past a trailing pad
            ends = np.full(len(items), query[-1]) if item_first and query else items.flat[items.offsets[1:] - 1]
            if (ends == pad).any():
                j = int(np.flatnonzero(ends == pad)[0])
                raise InvalidInput(
                    f"items[{j}]",
                    f"the sequence ends in the pad token {pad}, which the classifier's head skips (transformers reads "
                    "the last token that is not the pad token); drop it",
                )
        if item_first:
            sequences = TokenRows.from_lists([start + it + query for it in items])
            self.check_request_tokens(sequences.total)
            return TokenizedRequest((), sequences, labels, answer, True)
        self.check_request_tokens(len(start) + len(query) + items.total)
        return TokenizedRequest(tuple(start + query), items, labels, answer, False)

    def _has_tokenizer(self, field: str) -> TextTokenizer:
        if self.tokenizer is None:
            raise InvalidInput(field, f"model {self.cfg.name!r} has no tokenizer")
        return self.tokenizer

    def prompt_ids(self, prompt: object, add_special_tokens: bool = True) -> list[int]:
        """A text as the model's tokenizer encodes a whole prompt (vLLM's /tokenize), bounded
        by max_text_chars before it is tokenized."""
        if not isinstance(prompt, str):
            raise InvalidInput("prompt", "must be a string")
        tokenizer = self._has_tokenizer("prompt")
        if len(prompt) > self.limits.max_text_chars:
            limit = self.limits.max_text_chars
            raise InvalidInput(
                "prompt", f"text of {len(prompt)} characters exceeds the limit of {limit}", too_large=True
            )
        return tokenizer.encode_whole(prompt, bool(add_special_tokens))

    def tokenizer_info(self) -> dict[str, object]:
        """The served tokenizer's class, special tokens and chat template (vLLM's /tokenizer_info)."""
        return self._has_tokenizer("tokenizer").info(self.cfg.context_length)

    def text_of(self, tokens: object) -> str:
        """The text of token ids (vLLM's /detokenize), each checked against the vocabulary and
        their number against max_request_tokens."""
        if not _is_ids(tokens):
            raise InvalidInput("tokens", "must be a list of integer token ids")
        ids: list[int] = list(tokens)  # type: ignore[call-overload]
        tokenizer = self._has_tokenizer("tokens")
        limit = self.limits.max_request_tokens
        if limit is not None and len(ids) > limit:
            raise InvalidInput("tokens", f"{len(ids)} tokens exceed the limit of {limit}", too_large=True)
        check_ids("tokens", ids, self.cfg.vocab_size)
        return tokenizer.decode(ids)

    def label_ids(self, ids: Sequence[int], labels: Sequence[str]) -> tuple[int, ...]:
        """label_token_ids, or label strings resolved to single tokens; checked against the vocabulary."""
        limits = self.limits
        if ids and labels:
            raise InvalidInput("labels", "set either label_token_ids or labels, not both")
        if labels:
            if self.tokenizer is None:
                raise InvalidInput("labels", "the model has no tokenizer; send label_token_ids instead")
            if len(labels) > limits.max_labels:
                raise InvalidInput("labels", f"{len(labels)} labels exceed the limit of {limits.max_labels}")
            resolved = []
            for j, label in enumerate(labels):
                try:
                    resolved.append(self.tokenizer.token_id(label))
                except ValueError as err:
                    raise InvalidInput(f"labels[{j}]", str(err)) from err
            ids = resolved
        return check_labels(list(ids) if isinstance(ids, (list, tuple)) else ids, self.cfg.vocab_size, limits)

    def room(self, prefix_tokens: int) -> int:
        """The most tokens one item may have after `prefix_tokens` (start tokens + query)."""
        return min(self.max_item_tokens, self.max_sequence_tokens - prefix_tokens)

    def joined_differs(self, pairs: list[tuple[str, str]], separate: list[list[int]]) -> list[bool]:
        """For each (first, second) text pair: does tokenizing first + second as one string differ
        from the ids the server scored apart (`separate`, before truncation)?"""
        assert self.tokenizer is not None
        joined = self.tokenizer.encode_many([a + b for a, b in pairs])
        return [j != s for j, s in zip(joined, separate, strict=True)]
