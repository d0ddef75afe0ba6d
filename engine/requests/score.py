"""The label-score kind (SGLang's `/v1/score`, gRPC Score and ScoreStream): for each item, the
probabilities of a few label tokens as the next token after `query + item` (or a classifier's
outputs at its last token), with the query and items truncated as asked. A conversation may
stand for the query, its candidate assistant turns for the items (engine/requests/chat.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import Answer, TokenizedRequest
from prefixscore.engine.requests import chat, heads
from prefixscore.engine.requests.answers import for_head
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.truncation import (
    QUERY_TRUNCATION,
    TRUNCATE,
    TRUNCATION_SIDES,
    Truncation,
    choice,
    count,
    cut_items,
    cut_query,
)
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.engine.runtime.token_rows import TokenRows


@dataclasses.dataclass
class ScoreInput:
    """A score request as a transport received it (SGLang's fields, plus ours). With
    `loglikelihood` it is the likelihood kind's (engine/requests/likelihood.py)."""

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


@dataclasses.dataclass(frozen=True)
class Validated:
    """A validated score request: one engine request, what truncation cut, and (with
    check_tokenization) whether each item's text tokenizes differently joined to the query."""

    request: TokenizedRequest
    truncation: Truncation = Truncation()
    joined_differs: list[bool] | None = None

    @property
    def requests(self) -> tuple[TokenizedRequest, ...]:
        return (self.request,)

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_tokens


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """A validated stream open. prefix: start tokens + query (empty for item_first)."""

    query: list[int]
    kind: str  # "text" or "ids": every batch's items must be the same
    label_ids: tuple[int, ...]
    answer: Answer  # every batch's
    item_first: bool
    prefix: tuple[int, ...]


def input_kind(value: object) -> str:
    """ "text" or "ids": what a query is, which its items must match."""
    return "text" if isinstance(value, str) else "ids"


class ScoreKind:
    """Label scores (see the module doc). Result: [items, labels] float32."""

    name = "score"
    input_type = ScoreInput

    def __init__(self, requests: RequestTokenizer) -> None:
        self.requests = requests

    def head(
        self, ids: Sequence[int], labels: Sequence[str], activation: object, apply_softmax: bool
    ) -> heads.RequestHead:
        """What a request asks of the model's head (engine/requests/heads.py)."""
        return heads.for_request(self.requests.head, ids, labels, activation, apply_softmax, self.requests.label_ids)

    def plan(self, inp: ScoreInput) -> Validated:
        """A score request -> token ids, truncated as asked; raises InvalidInput naming the field."""
        if inp.loglikelihood:
            raise InvalidInput("loglikelihood", "is the likelihood kind's; send it there")
        requests = self.requests
        query_text, item_texts = inp.query, inp.items
        if inp.messages is not None:
            if inp.query is not None:
                raise InvalidInput("query", "set either query or messages")
            query_text, item_texts = chat.candidate_turns(requests.tokenizer, inp.messages, inp.items)
        asked = self.head(inp.label_token_ids, inp.labels, inp.activation, inp.apply_softmax)
        truncate = choice("truncate", inp.truncate, TRUNCATE)
        side = choice("truncation_side", inp.truncation_side, TRUNCATION_SIDES)
        how = choice("query_truncation", inp.query_truncation, QUERY_TRUNCATION)
        keep = count("max_query_tokens", inp.max_query_tokens)
        query = requests.query_ids(query_text, truncating=how != "none")  # type: ignore[arg-type]
        is_text = isinstance(query_text, str)
        items = requests.item_ids(item_texts, input_kind(query_text), truncating=truncate == "end")  # type: ignore[arg-type]
        if inp.check_tokenization and not is_text:
            raise InvalidInput("check_tokenization", "only applies to text inputs (token ids are not tokenized)")
        joined = None
        if inp.check_tokenization and items:
            texts = list(item_texts)  # type: ignore[call-overload]
            if inp.item_first:
                pairs, separate = [(t, query_text) for t in texts], [it + query for it in items]
            else:
                pairs, separate = [(query_text, t) for t in texts], [query + it for it in items]
            joined = requests.joined_differs(pairs, separate)  # type: ignore[arg-type]
        start = len(requests.start_ids)
        query, query_cut = cut_query(query, how, keep, requests.max_sequence_tokens - start - 1)
        report = Truncation(query_tokens=query_cut)
        if truncate == "end":
            items, cut = cut_items(items, requests.room(start + len(query)), side)
            report = dataclasses.replace(cut, query_tokens=query_cut)
        req = requests.assemble(query, items, asked.label_ids, for_head(asked), bool(inp.item_first))
        return Validated(req, report, joined)

    def answer(self, plan: Validated, done: Sequence[Done]) -> np.ndarray:
        (scores,) = done
        return scores.answer

    def stream_open(self, inp: ScoreInput) -> StreamSpec:
        """A stream's query, labels and options (no items yet)."""
        asked = self.head(inp.label_token_ids, inp.labels, inp.activation, inp.apply_softmax)
        ids = self.requests.query_ids(inp.query)  # type: ignore[arg-type]
        # no items yet: this checks the query leaves room for one and gives the prefix
        opened = self.requests.assemble(
            ids, TokenRows.coerce([]), asked.label_ids, for_head(asked), bool(inp.item_first)
        )
        return StreamSpec(ids, input_kind(inp.query), asked.label_ids, opened.answer, opened.item_first, opened.prefix)

    def stream_batch(self, spec: StreamSpec, items: object) -> TokenizedRequest:
        """One batch of an open stream, over the stream's query."""
        ids = self.requests.item_ids(items, spec.kind)  # type: ignore[arg-type]
        return self.requests.assemble(spec.query, ids, spec.label_ids, spec.answer, spec.item_first)
