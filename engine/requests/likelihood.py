"""The likelihood of items themselves: each continuation's tokens scored over a shared context.

A request is a context and continuations. Its work is the score path's: the context is the
prefix, prefilled once and kept in the prefix cache, and each continuation is an item over it.
The log-probability of a continuation's first token is read at the context's last token, so
that token travels with each item: the prefix is `context[:-1]` and item j is
`[context[-1]] + continuation[j]` (one token more per item; the pool and its cache hold the
rest). The device gives each item token a row (OUTPUT_TOKEN, model/call_inputs.py): the
log-probability of the item's next token over the whole vocabulary, and the vocabulary's top
log-probs there. Row i of an item reads its token i and targets token i + 1, so the rows of
a continuation's tokens are the item's first len(continuation); its last row has no target and
gives the top next tokens after the whole sequence.

A context of one token has no prefix: its items are whole sequences (`context + continuation`),
which read the same rows. The kind (`LikelihoodKind`: a score request with `loglikelihood`, gRPC
Score and ScoreStream, `Scorer.loglikelihood`) lays it out with `layout`, which /v1/completions
(engine/requests/completions.py) shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests import heads
from prefixscore.engine.requests.answers import TokenLogprobs
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.score import ScoreInput, StreamSpec, Validated, input_kind
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import TOP_LOGPROBS

# a score request's options that apply to label scores only: a likelihood request refuses each by
# name when it is sent (the value that means unset, per option)
_LABEL_OPTIONS = {
    "label_token_ids": lambda inp: bool(inp.label_token_ids),
    "labels": lambda inp: bool(inp.labels),
    "apply_softmax": lambda inp: bool(inp.apply_softmax),
    "item_first": lambda inp: bool(inp.item_first),
    "activation": lambda inp: inp.activation not in (None, "", "auto"),
    "messages": lambda inp: inp.messages is not None,
    "truncate": lambda inp: inp.truncate != "none",
    "query_truncation": lambda inp: inp.query_truncation != "none",
    "max_query_tokens": lambda inp: bool(inp.max_query_tokens),
    "check_tokenization": lambda inp: bool(inp.check_tokenization),
}


@dataclasses.dataclass(frozen=True)
class ItemLikelihood:
    """One continuation's likelihood over its context (natural log, float32 from the device)."""

    tokens: np.ndarray  # [n] int64: the continuation's token ids
    logprobs: np.ndarray  # [n] float32: log p(token i | context, tokens before i), over the whole vocabulary
    greedy: np.ndarray  # [n] bool: token i is the argmax at its position (the lowest id among ties)
    top_ids: np.ndarray  # [n, TOP_LOGPROBS] int64: the most likely tokens at each position, descending
    top_logprobs: np.ndarray  # [n, TOP_LOGPROBS] float32: their log-probs
    next_top_ids: np.ndarray  # [TOP_LOGPROBS] int64: the most likely tokens after the whole continuation
    next_top_logprobs: np.ndarray  # [TOP_LOGPROBS] float32

    @property
    def total(self) -> float:
        """log p(continuation | context): the sum of its tokens' log-probs (float64)."""
        return float(np.sum(self.logprobs, dtype=np.float64))

    @property
    def is_greedy(self) -> bool:
        """Whether greedy decoding after the context would produce the continuation."""
        return bool(self.greedy.all())


def token_positions(rows: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token rows [n, TOKEN_COLUMNS] whose targets are `tokens` [n]: each target's log-prob, the
    top ids [n, TOP_LOGPROBS] int64 and the top log-probs, where a position's own token is among
    them with its log-prob as the token's column says it. The device reads the two from different
    products, which can differ in the last bit, and a client that calls a token greedy when its
    log-prob equals the top one (lm-evaluation-harness over an API) must see one number. The
    token's column is the one kept: it does not depend on where the row sits in a call."""
    k = TOP_LOGPROBS
    logprobs, top_ids = rows[:, 0], rows[:, 1 + k :].astype(np.int64)
    top_logprobs = np.where(top_ids == tokens[:, None], logprobs[:, None], rows[:, 1 : 1 + k])
    return logprobs, top_ids, top_logprobs


def read_likelihoods(request: TokenizedRequest, token_rows: np.ndarray) -> list[ItemLikelihood]:
    """Each continuation's likelihood from the request's token rows [item tokens, TOKEN_COLUMNS]."""
    out = []
    k = TOP_LOGPROBS
    for j in range(len(request.items)):
        lo, hi = int(request.items.offsets[j]), int(request.items.offsets[j + 1])
        rows = token_rows[lo:hi]
        continuation = request.items.flat[lo + 1 : hi]
        logprobs, top_ids, top_logprobs = token_positions(rows[:-1], continuation)
        out.append(
            ItemLikelihood(
                tokens=continuation,
                logprobs=logprobs,
                greedy=top_ids[:, 0] == continuation,
                top_ids=top_ids,
                top_logprobs=top_logprobs,
                next_top_ids=rows[-1, 1 + k :].astype(np.int64),
                next_top_logprobs=rows[-1, 1 : 1 + k],
            )
        )
    return out


def check_top_logprobs(field: str, value: object) -> int:
    """How many top log-probs a likelihood reports at each position: 0 to TOP_LOGPROBS (the
    device computes that many)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= TOP_LOGPROBS:
        raise InvalidInput(field, f"{value!r} is not an integer from 0 to {TOP_LOGPROBS}")
    return value


def check_vocabulary_head(requests: RequestTokenizer) -> None:
    """An item's likelihood needs a vocabulary: a classifier's head has none, a base model no head."""
    heads.check_head(requests.head, "loglikelihood")
    if requests.head.own_rows:
        raise InvalidInput(
            "loglikelihood", "the model is a sequence classifier: it has no vocabulary to score an item's tokens"
        )


def layout(requests: RequestTokenizer, context: list[int], items: TokenRows, top_logprobs: int = 0) -> TokenizedRequest:
    """The items' own likelihood after `context`, laid out for the score path (see the module doc):
    the prefix is the context but its last token, which starts every item (its row reads the
    item's first token); a one-token context has no prefix (whole sequences). Checks every
    sequence fits the context and the request's tokens their limit."""
    check_vocabulary_head(requests)
    if not len(items):
        raise InvalidInput("items", "at least one item (continuation) is required")
    limit, item_limit = requests.max_sequence_tokens, requests.max_item_tokens
    totals = len(context) + items.lengths
    over = totals > limit
    if len(context) > 1:  # an item: the context's last token and the continuation
        over |= items.lengths + 1 > item_limit
    if over.any():
        j = int(np.flatnonzero(over)[0])
        if totals[j] > limit:
            why = f"query + item is {totals[j]} tokens, over the limit of {limit}"
        else:
            why = f"{items.lengths[j]} tokens, over the item limit of {item_limit - 1} after a query"
        raise InvalidInput(f"items[{j}]", why)
    lead = np.full(len(items), context[-1], np.int64)
    rows = TokenRows(np.insert(items.flat, items.offsets[:-1], lead), items.offsets + np.arange(len(items) + 1))
    prefix = tuple(context[:-1])
    requests.check_request_tokens(len(prefix) + rows.total)
    return TokenizedRequest(prefix, rows, (), TokenLogprobs(top_logprobs), not prefix)


class LikelihoodKind:
    """Each item's own likelihood after the query (see the module doc): a score request with
    `loglikelihood`. Result: an ItemLikelihood per item."""

    name = "likelihood"
    input_type = ScoreInput

    def __init__(self, requests: RequestTokenizer) -> None:
        self.requests = requests

    def _top_logprobs(self, inp: ScoreInput) -> int:
        """The request's top_logprobs, once the options that apply to label scores only are
        checked unset (each refused by name)."""
        for field, sent in _LABEL_OPTIONS.items():
            if sent(inp):
                raise InvalidInput(
                    field, "applies to label scores; a loglikelihood request scores the items' own tokens"
                )
        return check_top_logprobs("top_logprobs", inp.top_logprobs)

    def _context(self, query: object) -> list[int]:
        """The context: a text gets the model's start tokens (as a score request's query does);
        token ids are taken as given."""
        ids = self.requests.query_ids(query)  # type: ignore[arg-type]
        return list(self.requests.start_ids) + ids if isinstance(query, str) else ids

    def plan(self, inp: ScoreInput) -> Validated:
        top = self._top_logprobs(inp)
        context = self._context(inp.query)
        items = self.requests.item_ids(inp.items, input_kind(inp.query))  # type: ignore[arg-type]
        return Validated(layout(self.requests, context, items, top))

    def answer(self, plan: Validated, done: Sequence[Done]) -> list[ItemLikelihood]:
        (rows,) = done
        return read_likelihoods(plan.request, rows.answer)

    def stream_open(self, inp: ScoreInput) -> StreamSpec:
        """A likelihood stream's context (no items yet): checked to leave room for an item."""
        top = self._top_logprobs(inp)
        context = self._context(inp.query)
        check_vocabulary_head(self.requests)
        limit = self.requests.max_sequence_tokens
        if len(context) + 1 > limit:
            raise InvalidInput("query", f"{len(context)} tokens leave no room for an item within {limit} tokens")
        prefix = tuple(context[:-1])
        return StreamSpec(context, input_kind(inp.query), (), TokenLogprobs(top), not prefix, prefix)

    def stream_batch(self, spec: StreamSpec, items: object) -> TokenizedRequest:
        """One batch of an open stream, laid out as a request of its own over the stream's context."""
        assert isinstance(spec.answer, TokenLogprobs)
        ids = self.requests.item_ids(items, spec.kind)  # type: ignore[arg-type]
        return layout(self.requests, spec.query, ids, spec.answer.top_logprobs)
