"""What a request's rows are and how they become its answer: the one thing the device loop
knows of a request's kind.

A request kind (a label score, a rerank, a classification, an item's own likelihood, an
embedding) declares, as data, what its items take on the device and what comes back:

- `output`: which of a call's columns its rows read (model/call_inputs.py OUTPUT_*);
- `each_token`: a row per item token, or one per item (at its last token);
- `lead`: leading tokens every item repeats from the query (counted once in the prompt);
- `buffer`: its answer, zeroed, for a request's items;
- `fill`: a span of its rows written into that answer as a call comes back (the span's items,
  or for rows of the request's own prefix, its rows from the first).

The loop (engine/loop/batcher.py, engine/loop/work_unit.py) lays out and reads back rows through these
and never asks which kind a request is; the transports read the answer the kind filled. A
new kind is a new record here, not a branch in the loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prefixscore.engine.requests import heads
from prefixscore.engine.requests.pooling import PoolRows
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import (
    OUTPUT_FULL,
    OUTPUT_HIDDEN,
    OUTPUT_LOGIT,
    OUTPUT_SOFTMAX,
    OUTPUT_TOKEN,
    TOKEN_COLUMNS,
)


@dataclasses.dataclass(frozen=True)
class LabelScores:
    """A row per item at its last token, its label columns: the labels' probabilities over the
    vocabulary (OUTPUT_FULL), their softmax (OUTPUT_SOFTMAX), or their raw logits (OUTPUT_LOGIT,
    a classifier's or a logit-reading reranker's), then `activation` on the host
    (engine/requests/heads.py; "": none). Answer [items, labels] float32."""

    output: int = OUTPUT_FULL
    activation: str = ""
    each_token = False
    lead = 0

    def buffer(self, items: TokenRows, labels: int) -> np.ndarray:
        return np.zeros((len(items), labels), np.float32)

    def fill(self, answer: np.ndarray, items: TokenRows, first: int, count: int, rows: np.ndarray) -> None:
        answer[first : first + count] = heads.activate(rows, self.activation)


def label_scores(apply_softmax: bool = False, activation: str = "", raw_logits: bool = False) -> LabelScores:
    """The label rows a score request asks for: raw logits, the labels' softmax, or their
    probabilities over the whole vocabulary; `activation` applied on the host."""
    output = OUTPUT_LOGIT if raw_logits else OUTPUT_SOFTMAX if apply_softmax else OUTPUT_FULL
    return LabelScores(output, activation)


def for_head(head: heads.RequestHead) -> LabelScores:
    """The label rows of what a request asks of the model's head (engine/requests/heads.py)."""
    return label_scores(head.apply_softmax, head.activation, head.raw_logits)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """An item's own likelihood (engine/requests/likelihood.py): a row per item token, each the next
    token's log-prob, whether it is the argmax, and the top log-probs; every item starts with
    the query's last token (its row reads the item's first). Answer [item tokens, TOKEN_COLUMNS]
    float32, row i of an item its token i's. `top_logprobs`: how many a response reports."""

    top_logprobs: int = 0
    output = OUTPUT_TOKEN
    each_token = True
    lead = 1

    def buffer(self, items: TokenRows, labels: int) -> np.ndarray:
        return np.zeros((items.total, TOKEN_COLUMNS), np.float32)

    def fill(self, answer: np.ndarray, items: TokenRows, first: int, count: int, rows: np.ndarray) -> None:
        at = int(items.offsets[first])
        answer[at : at + len(rows)] = rows


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """A prompt's own likelihood from its prefill (engine/requests/completions.py): `rows` rows of
    its prefix, one per position from TokenizedRequest.prefix_rows on, each the next token's
    log-prob and the top log-probs (the last: the top next tokens after the prompt). Answer
    [rows, TOKEN_COLUMNS] float32, row i its position prefix_rows + i's."""

    rows: int
    output = OUTPUT_TOKEN
    each_token = True
    lead = 0

    def buffer(self, items: TokenRows, labels: int) -> np.ndarray:
        return np.zeros((self.rows, TOKEN_COLUMNS), np.float32)

    def fill(self, answer: np.ndarray, items: TokenRows, first: int, count: int, rows: np.ndarray) -> None:
        answer[first : first + count] = rows


@dataclasses.dataclass(frozen=True, eq=False)
class Pooled:
    """An embedding (engine/requests/pooling.py): the items' hidden rows (a row per token for a mean or a
    cls, else one at each item's last token), pooled as they come back. Answer [items, hidden]
    float32."""

    pool: PoolRows
    output = OUTPUT_HIDDEN
    lead = 0

    @property
    def each_token(self) -> bool:
        return self.pool.per_token

    def buffer(self, items: TokenRows, labels: int) -> np.ndarray:
        return np.zeros((len(items), self.pool.hidden), np.float32)

    def fill(self, answer: np.ndarray, items: TokenRows, first: int, count: int, rows: np.ndarray) -> None:
        answer[first : first + count] = self.pool.pooled(items, first, count, rows)
