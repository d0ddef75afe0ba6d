"""Validation and tokenization: the one pass every transport shares (gRPC, HTTP and the
in-process `Scorer`), before any device work.

A transport only maps its wire format onto `ScoreInput` / `RerankInput` (plain Python
values, unchecked) and maps the one error type, `InvalidInput` (which names the offending
field), onto its own status (gRPC: INVALID_ARGUMENT, also when `too_large`; HTTP: 400, or
413). Everything else happens here: labels, inputs, limits, truncation, templates and the
joined-tokenization check. The result is a request in token ids (`TokenizedRequest`),
ready for the batcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import chain

import numpy as np

from prefixscore.engine.loop.request import Answer, TokenizedRequest
from prefixscore.engine.requests import heads
from prefixscore.engine.requests.answers import TokenLogprobs, for_head
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.templates import RerankTemplate
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import TOP_LOGPROBS
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


def _plain_ints(x: Sequence[object]) -> bool:
    """Every element exactly an int (not a bool): one C-level pass, the common case of
    thousands of ids a request (a Python-level loop per id showed in W1's host time)."""
    return set(map(type, x)) <= {int}


def _is_ids(x: object) -> bool:
    return isinstance(x, (list, tuple)) and (
        _plain_ints(x) or all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def check_ids(field: str, ids: Sequence[int], vocab: int) -> None:
    if ids and _plain_ints(ids) and min(ids) >= 0 and max(ids) < vocab:
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

    def context_ids(self, context: str | Sequence[int]) -> list[int]:
        """A likelihood request's context: a text gets the model's start tokens (as a score
        request's query does); token ids are taken as given."""
        if isinstance(context, str):
            return list(self.start_ids) + self.query_ids(context)
        return self.query_ids(context)

    def check_vocabulary_head(self) -> None:
        """An item's likelihood needs a vocabulary: a classifier's head has none, a base model no head."""
        heads.check_head(self.head, "loglikelihood")
        if self.head.own_rows:
            raise InvalidInput(
                "loglikelihood", "the model is a sequence classifier: it has no vocabulary to score an item's tokens"
            )

    def likelihood(self, context: list[int], items: TokenRows, top_logprobs: int = 0) -> TokenizedRequest:
        """The items' own likelihood after `context` (engine/requests/likelihood.py), laid out for the
        score path: the prefix is the context but its last token, which starts every item (its
        row reads the item's first token); a one-token context has no prefix (whole sequences).
        Checks every sequence fits the context and the request's tokens their limit."""
        self.check_vocabulary_head()
        if not len(items):
            raise InvalidInput("items", "at least one item (continuation) is required")
        totals = len(context) + items.lengths
        over = totals > self.max_sequence_tokens
        if len(context) > 1:  # an item: the context's last token and the continuation
            over |= items.lengths + 1 > self.max_item_tokens
        if over.any():
            j = int(np.flatnonzero(over)[0])
            if totals[j] > self.max_sequence_tokens:
                why = f"query + item is {totals[j]} tokens, over the limit of {self.max_sequence_tokens}"
            else:
                why = f"{items.lengths[j]} tokens, over the item limit of {self.max_item_tokens - 1} after a query"
            raise InvalidInput(f"items[{j}]", why)
        lead = np.full(len(items), context[-1], np.int64)
        rows = TokenRows(np.insert(items.flat, items.offsets[:-1], lead), items.offsets + np.arange(len(items) + 1))
        prefix = tuple(context[:-1])
        self.check_request_tokens(len(prefix) + rows.total)
        return TokenizedRequest(prefix, rows, (), TokenLogprobs(top_logprobs), not prefix)


TRUNCATE = ("none", "end")
QUERY_TRUNCATION = ("none", "left", "right")
# the side an item (a document) loses tokens from when it is cut (vLLM's and LiteLLM's truncation_side)
TRUNCATION_SIDES = ("right", "left")


@dataclasses.dataclass
class ScoreInput:
    """A score request as a transport received it (SGLang's fields, plus ours)."""

    query: object  # text or token ids
    items: object  # texts or token-id lists
    label_token_ids: Sequence[int] = ()
    labels: Sequence[str] = ()  # label strings, one token each (instead of label_token_ids)
    apply_softmax: bool = False
    item_first: bool = False
    truncate: str = "none"  # an item too long: "none" rejects, "end" cuts it to fit
    truncation_side: str = "right"  # the side a cut item loses tokens from: "right" (its end) or "left"
    query_truncation: str = "none"  # a query too long: "none" rejects, "left"/"right" drop from that side
    max_query_tokens: int | None = None  # with query_truncation: the most query tokens kept
    check_tokenization: bool = False
    activation: str = "auto"  # a classifier's logits: auto, none, sigmoid or softmax (engine/requests/heads.py)
    # instead of `query`: a conversation whose next assistant turn each item is (a reward model's
    # candidates); the chat template renders it, split at that turn's content
    messages: object = None
    # each item's own likelihood after the query instead of label scores (engine/requests/likelihood.py),
    # with the top log-probs at each position (0 to TOP_LOGPROBS)
    loglikelihood: bool = False
    top_logprobs: int = 0


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
    truncation_side: str = "right"  # the side a cut document loses tokens from: "right" (its end) or "left"
    check_tokenization: bool = False


@dataclasses.dataclass
class ClassifyInput:
    """A classify request (vLLM's and SGLang's /v1/classify fields) as a transport received it."""

    input: object  # a text, texts, token ids, or token-id lists (None: `messages` instead)
    truncate_prompt_tokens: int | None = None  # keep each input's last n tokens (-1: as many as fit)
    activation: str = "auto"  # a classifier's logits (engine/requests/heads.py)
    labels: Sequence[str] = ()  # a causal LM: the label strings the server was started with
    # instead of `input`: a conversation (a list of {"role", "content"} messages), or several
    # (a list of them: one result each), rendered whole by the model's chat template
    messages: object = None


@dataclasses.dataclass(frozen=True)
class ValidatedClassify:
    """Inputs as one prefix (their longest common run of tokens, in whole pool pages) and one
    item each (the rest of every input)."""

    request: TokenizedRequest
    label_names: tuple[str, ...]
    prompt_tokens: int  # every input whole, start tokens included, as a forward pass of each sees it
    truncated_inputs: tuple[int, ...] = ()  # indices of the inputs truncate_prompt_tokens cut


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
    answer: Answer  # every batch's (a likelihood stream's: TokenLogprobs)
    item_first: bool
    prefix: tuple[int, ...]


def _choice(field: str, value: object, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InvalidInput(field, f"{value!r} is not one of {', '.join(allowed)}")
    return str(value)


def check_top_logprobs(field: str, value: object) -> int:
    """How many top log-probs a likelihood reports at each position: 0 to TOP_LOGPROBS (the
    device computes that many)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= TOP_LOGPROBS:
        raise InvalidInput(field, f"{value!r} is not an integer from 0 to {TOP_LOGPROBS}")
    return value


def _count(field: str, value: object) -> int | None:
    """An optional non-negative integer option (0 and None mean unset)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(field, f"must be a non-negative integer, got {value!r}")
    return value or None


class Validator:
    """Validates and tokenizes requests for one model (and its reranker template, if any)."""

    def __init__(
        self, requests: RequestTokenizer, template: RerankTemplate | None = None, no_template: str = ""
    ) -> None:
        self.requests = requests
        self.template = template
        # why a model with a tokenizer has no template (`--template auto` recognized none): rerank's refusal
        self.no_template = no_template
        self.max_sequence_tokens = requests.max_sequence_tokens
        self.max_item_tokens = requests.max_item_tokens

    # ---- pieces ----------------------------------------------------------------------------------
    def head(
        self, ids: Sequence[int], labels: Sequence[str], activation: object, apply_softmax: bool
    ) -> heads.RequestHead:
        """What a request asks of the model's head (engine/requests/heads.py)."""
        return heads.for_request(self.requests.head, ids, labels, activation, apply_softmax, self.labels)

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
    def _cut_items(
        items: TokenRows, room: int, side: str = "right", lead: Sequence[int] = ()
    ) -> tuple[TokenRows, Truncation]:
        """Items longer than `room` cut to it: their end dropped (side "right"), or their start
        (side "left"), keeping the ids an item shares with `lead` at its start (a template's
        document marker, such as "B: ", which belongs to the prompt rather than to the document;
        its last token may have merged with the document's first)."""
        lengths = items.lengths
        cut = np.flatnonzero(lengths > room)
        if not cut.size:
            return items, Truncation()
        dropped = int((lengths[cut] - room).sum())
        lead = list(lead)

        def left(row: list[int]) -> list[int]:
            if len(row) <= room:
                return row
            keep = 0
            while keep < min(len(lead), room - 1) and row[keep] == lead[keep]:
                keep += 1
            return row[:keep] + row[len(row) - (room - keep) :]

        cut_row = left if side == "left" else (lambda row: row[:room])
        return items.map_rows(cut_row), Truncation(items=tuple(cut.tolist()), item_tokens=dropped)

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
        if inp.loglikelihood:
            return Validated(self._likelihood(inp))
        if inp.messages is not None:
            inp = self._candidate_turns(inp)
        asked = self.head(inp.label_token_ids, inp.labels, inp.activation, inp.apply_softmax)
        truncate = _choice("truncate", inp.truncate, TRUNCATE)
        side = _choice("truncation_side", inp.truncation_side, TRUNCATION_SIDES)
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
            items, cut = self._cut_items(items, self._room(len(self.requests.start_ids) + len(query)), side)
            report = dataclasses.replace(cut, query_tokens=query_cut)
        req = self.requests.assemble(query, items, asked.label_ids, for_head(asked), bool(inp.item_first))
        return Validated(req, report, joined)

    def rerank(self, inp: RerankInput) -> ValidatedRerank:
        """A rerank request -> the template's prompt in token ids (prefix = everything up to the
        document; item = document + suffix), documents cut to fit as asked."""
        template = self.template
        if template is None and self.no_template:
            raise InvalidInput("template", self.no_template, precondition=True)
        if template is None:
            raise InvalidInput("documents", "the model has no tokenizer, so it has no reranker template")
        if not isinstance(inp.query, str):
            raise InvalidInput("query", "must be text")
        if not isinstance(inp.documents, (list, tuple)) or not all(isinstance(d, str) for d in inp.documents):
            raise InvalidInput("documents", "must be a list of strings")
        for j, doc in enumerate(inp.documents):
            if not doc:
                raise InvalidInput(f"documents[{j}]", "the document is empty")
        if inp.instruction and not template.record.takes_instruction:
            raise InvalidInput(
                "instruction", f"the {template.name} template's prompt takes no instruction; put it in the query"
            )
        truncate = _choice("truncate", inp.truncate, TRUNCATE)
        side = _choice("truncation_side", inp.truncation_side, TRUNCATION_SIDES)
        per_doc = _count("max_tokens_per_doc", inp.max_tokens_per_doc)
        top_n = _count("top_n", inp.top_n)
        if not inp.query:
            raise InvalidInput("query", "the query is empty")
        if len(inp.query) > self.requests.limits.max_text_chars:
            limit = self.requests.limits.max_text_chars
            raise InvalidInput("query", f"text of {len(inp.query)} characters exceeds the limit of {limit}")
        prompt = template.prompt(inp.query, inp.instruction)
        prefix, suffix = prompt.prefix_ids, prompt.suffix_ids
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
            docs, report = self._cut_items(docs, room, side, template.lead_ids)
        else:  # name the document, not the assembled item
            over = np.flatnonzero(docs.lengths > room)
            if over.size:
                j = int(over[0])
                raise InvalidInput(
                    f"documents[{j}]", f"{docs.lengths[j]} tokens, over the {room} that fit (truncate none)"
                )
        asked = heads.for_rerank(self.requests.head, template.label_ids, template.reads_logit)
        req = self.requests.assemble(prefix, docs.with_suffix(suffix), asked.label_ids, for_head(asked), False)
        return ValidatedRerank(Validated(req, report, joined), list(inp.documents), top_n)

    def classify(self, inp: ClassifyInput) -> ValidatedClassify:
        """Classify requests: each input scored whole, by the classifier's head or (a causal LM)
        the softmax over the configured label tokens. The inputs' longest common token prefix,
        rounded down to whole pages of the pool (and leaving every input at least one token), is
        the shared prefix, prefilled once; the rest of each input is its item."""
        asked, names = heads.for_classify(self.requests.head, inp.labels, inp.activation, self.labels)
        if (inp.input is None) == (inp.messages is None):
            raise InvalidInput("input", "set either input or messages")
        raw = inp.input if inp.messages is None else self._conversations(inp.messages)
        if isinstance(raw, str) or (isinstance(raw, list) and raw and _plain_ints(raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise InvalidInput("input", "must be a string, a list of strings, token ids or a list of token-id lists")
        keep = inp.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < -1 or keep == 0):
            raise InvalidInput("truncate_prompt_tokens", f"must be a positive integer or -1, got {keep!r}")
        rows = self.requests.item_ids(raw, field="input", truncating=keep is not None)
        start = list(self.requests.start_ids)
        inputs = [list(r) for r in rows]
        cut: list[int] = []
        if keep is not None:  # vLLM's: the last `keep` tokens of each input (-1: all that fit)
            budget = self.max_sequence_tokens - len(start) if keep == -1 else keep
            for j, ids in enumerate(inputs):
                if len(ids) > budget:
                    inputs[j], cut = ids[len(ids) - budget :], [*cut, j]
        for j, ids in enumerate(inputs):
            if len(start) + len(ids) > self.max_sequence_tokens:
                raise InvalidInput(
                    f"input[{j}]", f"{len(start) + len(ids)} tokens, over the limit of {self.max_sequence_tokens}"
                )
        shared = min(len(ids) for ids in inputs) - 1  # every item keeps a token
        first = inputs[0]
        head = np.asarray(first)
        for ids in inputs[1:]:  # the longest common prefix, one array comparison per input
            differ = np.flatnonzero(np.asarray(ids[:shared]) != head[:shared])
            shared = int(differ[0]) if differ.size else shared
        page = self.requests.limits.page_tokens
        shared = max(0, (len(start) + shared) // page * page - len(start))
        prompt_tokens = sum(len(start) + len(ids) for ids in inputs)
        items = TokenRows.from_lists([ids[shared:] for ids in inputs])
        try:  # without a shared prefix the inputs are whole sequences (start + input)
            req = self.requests.assemble(first[:shared], items, asked.label_ids, for_head(asked), not shared)
        except InvalidInput as err:
            raise InvalidInput(err.field.replace("items", "input", 1), err.message, err.too_large) from err
        return ValidatedClassify(req, names, prompt_tokens, tuple(cut))

    def _candidate_turns(self, inp: ScoreInput) -> ScoreInput:
        """A conversation and candidate assistant turns -> the query (the conversation rendered up
        to the next assistant turn's content) and items (each candidate + the turn's end)."""
        if inp.query is not None:
            raise InvalidInput("query", "set either query or messages")
        if not isinstance(inp.items, list) or not all(isinstance(it, str) for it in inp.items):
            raise InvalidInput("items", "with messages, items are the candidate assistant turns' texts")
        if not isinstance(inp.messages, list) or not inp.messages or not isinstance(inp.messages[0], dict):
            raise InvalidInput("messages", "must be a conversation (a list of messages)")
        mark = "\x00prefixscore-turn\x00"
        (text,) = self._conversations([*inp.messages, {"role": "assistant", "content": mark}])
        before, found, after = text.partition(mark)
        if not found:
            raise InvalidInput("messages", "the chat template does not render an assistant turn's content as it is")
        return dataclasses.replace(inp, query=before, items=[c + after for c in inp.items], messages=None)

    def _conversations(self, messages: object) -> list[str]:
        """One conversation or a list of them -> each rendered whole by the chat template (the
        text a reward model reads; conversations that share their leading turns share tokens)."""
        tokenizer = self.requests.tokenizer
        if tokenizer is None or not getattr(tokenizer.hf, "chat_template", None):
            raise InvalidInput("messages", "the model's tokenizer has no chat template; send input instead")
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("messages", "must be a conversation (a list of messages) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        texts = []
        for j, conversation in enumerate(conversations):
            where = "messages" if conversations is not messages else f"messages[{j}]"
            if not isinstance(conversation, list) or not conversation:
                raise InvalidInput(where, "must be a non-empty list of messages")
            for k, message in enumerate(conversation):
                if not (
                    isinstance(message, dict)
                    and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)
                ):
                    raise InvalidInput(f"{where}[{k}]", 'must be {"role": str, "content": str}')
            try:
                texts.append(tokenizer.hf.apply_chat_template(conversation, tokenize=False))
            except Exception as err:  # the template's own check (roles out of order, ...)
                raise InvalidInput(where, f"the chat template refused it: {err}") from err
        return texts

    def _likelihood_options(self, inp: ScoreInput) -> int:
        """A likelihood request's top_logprobs, once the options that apply to label scores
        only are checked unset (each refused by name)."""
        label_options = {
            "label_token_ids": bool(inp.label_token_ids),
            "labels": bool(inp.labels),
            "apply_softmax": bool(inp.apply_softmax),
            "item_first": bool(inp.item_first),
            "activation": inp.activation not in (None, "", "auto"),
            "messages": inp.messages is not None,
            "truncate": inp.truncate != "none",
            "query_truncation": inp.query_truncation != "none",
            "max_query_tokens": bool(inp.max_query_tokens),
            "check_tokenization": bool(inp.check_tokenization),
        }
        for field, sent in label_options.items():
            if sent:
                raise InvalidInput(
                    field, "applies to label scores; a loglikelihood request scores the items' own tokens"
                )
        return check_top_logprobs("top_logprobs", inp.top_logprobs)

    def _likelihood(self, inp: ScoreInput) -> TokenizedRequest:
        top = self._likelihood_options(inp)
        context = self.requests.context_ids(inp.query)  # type: ignore[arg-type]
        kind = "text" if isinstance(inp.query, str) else "ids"
        return self.requests.likelihood(context, self.requests.item_ids(inp.items, kind), top)  # type: ignore[arg-type]

    def stream_open(self, inp: ScoreInput) -> StreamSpec:
        """A stream's query, labels and options (no items yet)."""
        if inp.loglikelihood:
            top = self._likelihood_options(inp)
            context = self.requests.context_ids(inp.query)  # type: ignore[arg-type]
            self.requests.check_vocabulary_head()
            if len(context) + 1 > self.requests.max_sequence_tokens:
                limit = self.requests.max_sequence_tokens
                raise InvalidInput("query", f"{len(context)} tokens leave no room for an item within {limit} tokens")
            kind = "text" if isinstance(inp.query, str) else "ids"
            prefix = tuple(context[:-1])
            return StreamSpec(context, kind, (), TokenLogprobs(top), not prefix, prefix)
        asked = self.head(inp.label_token_ids, inp.labels, inp.activation, inp.apply_softmax)
        ids = self.requests.query_ids(inp.query)
        # no items yet: this checks the query leaves room for one and gives the prefix
        opened = self.requests.assemble(
            ids, TokenRows.coerce([]), asked.label_ids, for_head(asked), bool(inp.item_first)
        )
        kind = "text" if isinstance(inp.query, str) else "ids"
        return StreamSpec(ids, kind, asked.label_ids, opened.answer, opened.item_first, opened.prefix)

    def stream_batch(self, spec: StreamSpec, items: object) -> TokenizedRequest:
        """One batch of an open stream, over the stream's query."""
        ids = self.requests.item_ids(items, spec.kind)  # type: ignore[arg-type]
        if isinstance(spec.answer, TokenLogprobs):  # a likelihood stream: each batch laid out as one
            return self.requests.likelihood(spec.query, ids, spec.answer.top_logprobs)
        return self.requests.assemble(spec.query, ids, spec.label_ids, spec.answer, spec.item_first)
