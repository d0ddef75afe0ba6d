"""No item can see another: changing, lengthening or removing one item never moves another's score,
and neither does item order or how items are split across calls."""

from __future__ import annotations

import numpy as np

TOL = 1e-6
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
        assert np.abs(got[others] - base[others]).max() <= TOL
        assert np.abs(got[j] - base[j]).max() > 1e-6  # the changed item itself did move
    removed = items[:j] + items[j + 1 :]
    got = np.array(tiny_scorer.score(query, removed, LABELS))
    assert np.abs(got - np.delete(base, j, axis=0)).max() <= TOL


def test_order_and_splitting_do_not_matter(tiny_scorer):
    rng = np.random.default_rng(1)
    query = rng.integers(0, 49152, 100).tolist()
    items = _items(rng, 20)
    base = np.array(tiny_scorer.score(query, items, LABELS))
    perm = rng.permutation(len(items))
    shuffled = np.array(tiny_scorer.score(query, [items[i] for i in perm], LABELS))
    assert np.abs(shuffled - base[perm]).max() <= TOL
    parts = [np.array(tiny_scorer.score(query, items[a:b], LABELS)) for a, b in ((0, 1), (1, 8), (8, 20))]
    assert np.abs(np.concatenate(parts) - base).max() <= TOL
    one_by_one = np.concatenate([np.array(tiny_scorer.score(query, [it], LABELS)) for it in items[:4]])
    assert np.abs(one_by_one - base[:4]).max() <= TOL


def test_modes_agree(tiny_scorer):
    """prefix (ours), sequential (one forward per item) and packed (one sequence, block-diagonal mask)."""
    rng = np.random.default_rng(2)
    query = rng.integers(0, 49152, 60).tolist()
    items = _items(rng, 6)
    for apply_softmax in (False, True):
        prefix = np.array(tiny_scorer.score(query, items, LABELS, apply_softmax=apply_softmax))
        for mode in ("sequential", "packed"):
            other = np.array(tiny_scorer.score(query, items, LABELS, apply_softmax=apply_softmax, mode=mode))
            assert np.abs(other - prefix).max() <= 1e-5, mode


def test_text_inputs_and_usage(tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    query = "Decide whether the item matches the user's taste in music:"
    items = [" jazz piano trio", " death metal", " baroque harpsichord sonatas"]
    labels = [tok.token_id(" yes"), tok.token_id(" no")]
    text = np.array(tiny_scorer.score(query, items, labels))
    assert tiny_scorer.last_usage.items == 3
    ids = np.array(tiny_scorer.score(tok.encode(query), [tok.encode(it) for it in items], labels))
    # separate tokenization: the text request equals the ids of each part concatenated
    assert np.abs(text - ids).max() <= TOL
    q_len = len(tok.start_ids) + len(tok.encode(query))
    assert tiny_scorer.last_usage.cached_tokens == q_len  # second call hit the prefix cache
    assert tiny_scorer.last_usage.prompt_tokens == q_len + sum(len(tok.encode(it)) for it in items)
    assert tiny_scorer.score(query, [], labels) == []
