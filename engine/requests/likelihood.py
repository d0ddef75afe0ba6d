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
which read the same rows. The request is laid out and checked by `RequestTokenizer.likelihood`
(engine/requests/validation.py), the one validation pass of every transport.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.model.call_inputs import TOP_LOGPROBS


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


def _top_as_token(
    top_logprobs: np.ndarray, top_ids: np.ndarray, logprobs: np.ndarray, tokens: np.ndarray
) -> np.ndarray:
    """The top log-probs, where a position's own token is among them with its log-prob as the
    token's column says it: the device reads the two from different products, which can differ
    in the last bit, and a client that calls a token greedy when its log-prob equals the top one
    (lm-evaluation-harness over an API) must see one number. The token's column is the one kept:
    it does not depend on where the row sits in a call."""
    where = top_ids == tokens[:, None]  # [n, TOP_LOGPROBS]
    return np.where(where, logprobs[:, None], top_logprobs)


def read_likelihoods(request: TokenizedRequest, token_rows: np.ndarray) -> list[ItemLikelihood]:
    """Each continuation's likelihood from the request's token rows [item tokens, TOKEN_COLUMNS]."""
    out = []
    k = TOP_LOGPROBS
    for j in range(len(request.items)):
        lo, hi = int(request.items.offsets[j]), int(request.items.offsets[j + 1])
        item = request.items.flat[lo:hi]
        rows = token_rows[lo:hi]
        top_ids = rows[:, 1 + k :].astype(np.int64)
        continuation = item[1:]
        out.append(
            ItemLikelihood(
                tokens=continuation,
                logprobs=rows[:-1, 0],
                greedy=top_ids[:-1, 0] == continuation,
                top_ids=top_ids[:-1],
                top_logprobs=_top_as_token(rows[:-1, 1 : 1 + k], top_ids[:-1], rows[:-1, 0], continuation),
                next_top_ids=top_ids[-1],
                next_top_logprobs=rows[-1, 1 : 1 + k],
            )
        )
    return out
