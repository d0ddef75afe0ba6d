"""The packed baseline's call (the seeds' `packed`, model/packed_baseline.py): a query and all
its items laid out as one sequence under a block-diagonal mask, and run on the whole model. The
engine runs it (engine/runtime/scoring_engine.py `score_packed`, on one device's whole model) so
the bench can report the prefix path's speed-up over it; it is compiled on first use per
length (multiples of packed_baseline.PACKED_ALIGN), never warmed up.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from prefixscore.engine.runtime.buckets import Buckets, round_up
from prefixscore.model import packed_baseline
from prefixscore.model.config import ModelConfig
from prefixscore.model.weights import Weights


def score_packed(
    params: Weights,
    cfg: ModelConfig,
    label_buckets: tuple[int, ...],
    query_ids: Sequence[int],
    items: Sequence[Sequence[int]],
    label_ids: Sequence[int],
    apply_softmax: bool,
) -> np.ndarray:
    """The label probabilities [items, labels] of each item read after the query, every item in
    one packed sequence; the label ids padded to one of `label_buckets`."""
    total = len(query_ids) + sum(len(it) for it in items)
    s = round_up(total, packed_baseline.PACKED_ALIGN)
    tokens = np.zeros(s, np.int32)
    positions = np.zeros(s, np.int32)
    segments = np.full(s, -1, np.int32)
    q = len(query_ids)
    tokens[:q], positions[:q], segments[:q] = query_ids, np.arange(q), 0
    read_at = np.zeros(len(items), np.int32)
    at = q
    for i, item in enumerate(items):
        n = len(item)
        tokens[at : at + n] = item
        positions[at : at + n] = q + np.arange(n)
        segments[at : at + n] = i + 1
        read_at[i] = at + n - 1
        at += n
    ids = np.zeros(Buckets.fit(label_buckets, len(label_ids), "label_token_ids"), np.int32)
    ids[: len(label_ids)] = label_ids
    valid = np.arange(len(ids)) < len(label_ids)
    probs = packed_baseline.score_packed(
        params,
        cfg,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        jnp.asarray(segments),
        jnp.asarray(read_at),
        jnp.asarray(ids),
        jnp.asarray(valid),
        apply_softmax=apply_softmax,
    )
    return np.asarray(probs)[:, : len(label_ids)]
