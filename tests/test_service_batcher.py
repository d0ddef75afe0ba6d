"""The batcher alone (no device): grouping, merging across requests, planning windows, order, cancellation."""

from __future__ import annotations

import dataclasses

from prefixscore.model.buckets import Buckets
from prefixscore.service.batcher import Batcher, WorkUnit


@dataclasses.dataclass
class Shape:
    indices: tuple[int, ...]


def planner(capacity_tokens: int = 16):
    """A stand-in for ScoringEngine.plan: longest first, greedy up to `capacity_tokens` per call."""
    calls: list[tuple[list[int], bool]] = []

    def plan(lengths, sequence=False):
        calls.append((list(lengths), sequence))
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        out, current, used = [], [], 0
        for i in order:
            if current and used + lengths[i] > capacity_tokens:
                out.append(Shape(tuple(current)))
                current, used = [], 0
            current.append(i)
            used += lengths[i]
        return [*out, Shape(tuple(current))]

    plan.calls = calls
    return plan


def unit(prefix=(1, 2, 3), lengths=(3,), labels=(5, 6), softmax=False, item_first=False) -> WorkUnit:
    return WorkUnit(tuple(prefix), [[7] * n for n in lengths], tuple(labels), softmax, item_first)


def resolved(batcher: Batcher) -> None:
    for group in batcher.unresolved():
        group.state = "kv"
        group.waiting.clear()


def test_requests_sharing_a_query_merge_into_one_batch():
    b = Batcher(planner(), window=8)
    a, c = unit(lengths=(3, 4)), unit(lengths=(5,))
    b.add(a)
    b.add(c)
    assert b.depth == 3
    assert b.next_batch() is None  # the prefix is not on the device yet
    resolved(b)
    batch = b.next_batch()
    assert [(u is a, i) for u, i in batch.entries] == [(True, 0), (True, 1), (False, 0)]
    assert batch.tokens == 12
    assert b.depth == 0 and a.queued == 0 and c.queued == 0
    assert b.next_batch() is None
    assert len(b.prune()) == 1 and not b.groups


def test_different_queries_labels_or_options_do_not_merge():
    b = Batcher(planner(), window=8)
    for u in (unit(), unit(prefix=(9,)), unit(labels=(5,)), unit(softmax=True), unit(item_first=True)):
        b.add(u)
    resolved(b)
    sizes = []
    while (batch := b.next_batch()) is not None:
        sizes.append(len(batch.entries))
    assert sizes == [1, 1, 1, 1, 1]


def test_planner_sees_a_window_and_the_rest_stays_in_order():
    plan = planner(capacity_tokens=10)
    b = Batcher(plan, window=4)
    first = unit(lengths=(2, 9, 2, 2, 2, 2))
    b.add(first)
    resolved(b)
    batch = b.next_batch()
    assert plan.calls[-1] == ([2, 9, 2, 2], False)  # only the window's 4 oldest items
    assert [i for _, i in batch.entries] == [1]  # the planner's first call: the longest item
    batch = b.next_batch()
    assert plan.calls[-1] == ([2, 2, 2, 2], False)  # what was left, oldest first
    assert [i for _, i in batch.entries] == [0, 2, 3, 4]
    assert [i for _, i in b.next_batch().entries] == [5]
    assert b.depth == 0


def test_oldest_group_goes_first_and_item_first_plans_as_sequences():
    plan = planner()
    b = Batcher(plan, window=8)
    old, new = unit(item_first=True), unit()
    b.add(old)
    b.add(new)
    resolved(b)
    assert b.next_batch().entries[0][0] is old and plan.calls[-1][1] is True
    assert b.next_batch().entries[0][0] is new and plan.calls[-1][1] is False


def test_cancelled_units_leave_the_queue():
    b = Batcher(planner(), window=8)
    a, c = unit(lengths=(3, 3)), unit(lengths=(3,))
    b.add(a)
    b.add(c)
    resolved(b)
    b.cancel(a)
    assert b.depth == 1
    batch = b.next_batch()
    assert [u for u, _ in batch.entries] == [c]
    assert b.depth == 0 and not b.ready()


def test_a_unit_joining_a_resolved_group_counts_the_prefix_as_cached():
    b = Batcher(planner(), window=8)
    first = unit(lengths=(3,))
    b.add(first)
    resolved(b)
    second = unit(lengths=(3,))
    b.add(second)
    assert second.cached_tokens == 3 and first.cached_tokens == 0


def test_with_the_engine_planner(tiny_scorer):
    """The real ScoringEngine.plan: a window of mixed lengths becomes one packed call."""
    engine = tiny_scorer.engine
    b = Batcher(lambda lengths, seq: engine.plan(lengths, sequence=seq), window=64)
    units = [unit(lengths=(3, 20)), unit(lengths=(7,)), unit(lengths=(1, 1, 1))]
    for u in units:
        b.add(u)
    resolved(b)
    batch = b.next_batch()
    assert len(batch.entries) == 6 and b.depth == 0
    assert isinstance(engine.buckets, Buckets)
