"""No item can see another: changing, lengthening or removing one item never moves another's score,
and neither does item order or how items are split across calls."""

from __future__ import annotations

import numpy as np
from helpers.compare import log_gap

# in log space: the probabilities are full-vocabulary ones of 1.2e-5 to 3.2e-5. Measured: every
# comparison below is exact (0) on CPU; items that see their neighbours (the item mask's segment
# check dropped, kernels/xla.py `_two_blocks`) move the others by 5.4e-2 in log space (1.0e-6
# absolute, which the old absolute tolerance of 1e-6 let pass), 5,000 times TOL
TOL = 1e-5
LABELS = [9454 % 49152, 2753, 11, 42]


def _items(rng, n=12):
    return [rng.integers(0, 49152, int(rng.integers(1, 30))).tolist() for _ in range(n)]


def test_changing_one_item_moves_no_other(tiny_scorer):
    rng = np.random.default_rng(0)
    query = rng.integers(0, 49152, 70).tolist()
    items = _items(rng)
    base = np.array(tiny_scorer.score(query, items, LABELS))
    j = 5
    changed = [list(it) for it in items]
    changed[j] = rng.integers(0, 49152, len(items[j])).tolist()
    longer = [list(it) for it in items]
    longer[j] = items[j] + rng.integers(0, 49152, 25).tolist()  # moves it to another length bucket
    for variant in (changed, longer):
        got = np.array(tiny_scorer.score(query, variant, LABELS))
        others = [i for i in range(len(items)) if i != j]
        assert log_gap(got[others], base[others]) <= TOL
        assert log_gap(got[j], base[j]) > 100 * TOL  # the changed item itself did move
    removed = items[:j] + items[j + 1 :]
    got = np.array(tiny_scorer.score(query, removed, LABELS))
    assert log_gap(got, np.delete(base, j, axis=0)) <= TOL


def test_order_and_splitting_do_not_matter(tiny_scorer):
    rng = np.random.default_rng(1)
    query = rng.integers(0, 49152, 100).tolist()
    items = _items(rng, 20)
    base = np.array(tiny_scorer.score(query, items, LABELS))
    perm = rng.permutation(len(items))
    shuffled = np.array(tiny_scorer.score(query, [items[i] for i in perm], LABELS))
    assert log_gap(shuffled, base[perm]) <= TOL
    parts = [np.array(tiny_scorer.score(query, items[a:b], LABELS)) for a, b in ((0, 1), (1, 8), (8, 20))]
    assert log_gap(np.concatenate(parts), base) <= TOL
    one_by_one = np.concatenate([np.array(tiny_scorer.score(query, [it], LABELS)) for it in items[:4]])
    assert log_gap(one_by_one, base[:4]) <= TOL


# the three modes lay the same arithmetic out differently (no prefix cache, one packed sequence):
# float32 rounding apart (2.5e-7 in log space at most, measured); another item's scores are 0.4 away
MODES_TOL = 1e-5


def test_modes_agree(tiny_scorer):
    """prefix (ours), sequential (one forward per item) and packed (one sequence, block-diagonal mask)."""
    rng = np.random.default_rng(2)
    query = rng.integers(0, 49152, 60).tolist()
    items = _items(rng, 6)
    for apply_softmax in (False, True):
        prefix = np.array(tiny_scorer.score(query, items, LABELS, apply_softmax=apply_softmax))
        for mode in ("sequential", "packed"):
            other = np.array(tiny_scorer.score(query, items, LABELS, apply_softmax=apply_softmax, mode=mode))
            assert log_gap(other, prefix) <= MODES_TOL, mode


def test_text_inputs_and_usage(tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    query = "Decide whether the item matches the user's taste in music:"
    items = [" jazz piano trio", " death metal", " baroque harpsichord sonatas"]
    labels = [tok.token_id(" yes"), tok.token_id(" no")]
    text = np.array(tiny_scorer.score(query, items, labels))
    assert tiny_scorer.last_usage.items == 3
    ids = np.array(tiny_scorer.score(tok.encode(query), [tok.encode(it) for it in items], labels))
    # separate tokenization: the text request equals the ids of each part concatenated
    assert log_gap(text, ids) <= TOL
    q_len = len(tok.start_ids) + len(tok.encode(query))
    assert tiny_scorer.last_usage.cached_tokens == q_len  # second call hit the prefix cache
    assert tiny_scorer.last_usage.prompt_tokens == q_len + sum(len(tok.encode(it)) for it in items)
    assert tiny_scorer.score(query, [], labels) == []
