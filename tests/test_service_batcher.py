"""The batcher alone (no device): grouping, merging across requests, capacity, order, cancellation."""

from __future__ import annotations

from prefixscore.model.buckets import Buckets
from prefixscore.service.batcher import Batcher, WorkUnit

BUCKETS = Buckets(prefix=(64, 128), item=(8, 16), batch=(1, 2, 4, 8), max_batch_tokens=64)


def unit(prefix=(1, 2, 3), lengths=(3,), labels=(5, 6), softmax=False, item_first=False) -> WorkUnit:
    return WorkUnit(tuple(prefix), [[7] * n for n in lengths], tuple(labels), softmax, item_first)


def resolved(batcher: Batcher) -> None:
    for group in batcher.unresolved():
        group.state = "kv"
        group.waiting.clear()


def test_requests_sharing_a_query_merge_into_one_batch():
    b = Batcher(BUCKETS)
    a, c = unit(lengths=(3, 4)), unit(lengths=(5,))
    b.add(a)
    b.add(c)
    assert b.depth == 3
    assert b.next_batch() is None  # the prefix is not on the device yet
    resolved(b)
    batch = b.next_batch()
    assert [(u is a, i) for u, i in batch.entries] == [(True, 0), (True, 1), (False, 0)]
    assert (batch.length, batch.size, batch.tokens) == (8, 4, 12)
    assert b.depth == 0 and a.queued == 0 and c.queued == 0
    assert b.next_batch() is None
    assert len(b.prune()) == 1 and not b.groups


def test_different_queries_labels_or_options_do_not_merge():
    b = Batcher(BUCKETS)
    for u in (unit(), unit(prefix=(9,)), unit(labels=(5,)), unit(softmax=True), unit(item_first=True)):
        b.add(u)
    resolved(b)
    sizes = []
    while (batch := b.next_batch()) is not None:
        sizes.append(len(batch.entries))
    assert sizes == [1, 1, 1, 1, 1]


def test_capacity_length_buckets_and_oldest_first():
    b = Batcher(BUCKETS)  # capacity: 8 items of length 8, 4 of length 16 (max_batch_tokens 64)
    long_first = unit(lengths=(12,) * 5)
    short = unit(lengths=(2,) * 10)
    b.add(long_first)
    b.add(short)
    resolved(b)
    shapes = []
    while (batch := b.next_batch()) is not None:
        shapes.append((batch.length, len(batch.entries), batch.size))
    # the oldest item is long: its bucket goes first; capacity splits the rest
    assert shapes == [(16, 4, 4), (16, 1, 1), (8, 8, 8), (8, 2, 2)]


def test_cancelled_units_leave_the_queue():
    b = Batcher(BUCKETS)
    a, c = unit(lengths=(3, 3)), unit(lengths=(3,))
    b.add(a)
    b.add(c)
    resolved(b)
    b.cancel(a)
    assert b.depth == 1
    batch = b.next_batch()
    assert [u for u, _ in batch.entries] == [c]
    assert b.depth == 0


def test_a_unit_joining_a_resolved_group_counts_the_prefix_as_cached():
    b = Batcher(BUCKETS)
    first = unit(lengths=(3,))
    b.add(first)
    resolved(b)
    second = unit(lengths=(3,))
    b.add(second)
    assert second.cached_tokens == 3 and first.cached_tokens == 0
