"""An embedding's pooling on the host: the device's hidden rows (OUTPUT_HIDDEN) into one vector
per item, as sentence-transformers' Pooling module computes it from a Transformer's output.

A row is the final-normed hidden state at one token (model/step.py). Last-token pooling reads
one row per item, at its last token. Mean and cls pooling read a row per token (the planner
gives such items a row each, as a likelihood's): a mean sums the tokens it counts, a cls takes
the first one it counts. An item's first `skip` tokens are not counted: the part of a prompt
the item carries when the prompt stays out of the pool (`include_prompt: false`) and the
prefix did not take all of it (engine/requests/embedding.py). The rows come back span by span
(engine/loop/batcher.py take_results); each span is whole items, so it is reduced as it arrives and
a request never holds a row per token of all its items.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.sentence_config import CLS, LAST


@dataclasses.dataclass(frozen=True, eq=False)
class PoolRows:
    """How a request's hidden rows become one vector per item."""

    mode: str  # model/sentence_config.py's LAST, MEAN or CLS
    skip: np.ndarray  # [items] int64: each item's leading tokens kept out of the pool
    hidden: int  # the model's hidden size: a row's width

    @property
    def per_token(self) -> bool:
        """A row per item token (mean, cls), else one per item (its last token)."""
        return self.mode != LAST

    def pooled(self, items: TokenRows, first: int, count: int, rows: np.ndarray) -> np.ndarray:
        """Items first .. first + count - 1 pooled from their rows ([count, hidden] for LAST;
        [their tokens, hidden] for MEAN and CLS, item by item in order) -> [count, hidden] float32."""
        if self.mode == LAST:
            return rows
        offsets = items.offsets[first : first + count + 1] - items.offsets[first]
        lengths = np.diff(offsets)
        skip = self.skip[first : first + count]  # engine/requests/embedding.py left each item a token past it
        if self.mode == CLS:
            return rows[offsets[:-1] + skip]
        index = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)  # each row's token in its item
        counted = index >= np.repeat(skip, lengths)
        sums = np.add.reduceat(np.where(counted[:, None], rows.astype(np.float64), 0.0), offsets[:-1], axis=0)
        return (sums / (lengths - skip)[:, None]).astype(np.float32)


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 norm, in float64 (a zero row stays zero)."""
    x = np.asarray(x, np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
