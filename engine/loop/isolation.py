"""Which work a failed device call takes down: only the work that fails again on its own.

One device call carries the work of many requests, so when it fails (a device error, an
out-of-memory on its shape, a read-back error) the request at fault cannot be told from
the others riding with it. One rule holds for everything a call carries (items of any
kind, a query's prefill, a stream open's prefill-only unit): the work is retried in calls
that carry strictly less of it, and only work that fails in a call of its own fails its
owner:

- a call over several queries: its work is retried one group per query when it carried
  at most ONE_BY_ONE queries, else in two halves by query. Each group is a call of its
  own (engine/loop/batcher.py), which fails again only if something in it is at fault;
- a group's query that must be prefilled again is prefilled first, alone (engine/
  recovery.py gives the group a unit without items, the batcher plans it alone): a
  prefill that fails alone fails every request and stream open over that query;
- a retried call over one query: its items in two halves (smaller calls: an
  out-of-memory on a shape also passes this way), down to one item, which fails its
  request. Requests waiting on that query try once more alone.

Pages the failed call wrote may hold garbage: those queries are prefilled again
(PrefixCache.rewrite), and the work of the call's own isolation scope (its group, or
ungrouped work for an ungrouped call) queued over them rides with its query's retry, so
the new prefill is isolated too. Each step carries strictly less than the call that
failed, so a request with n items over q queries in a call is retried at most about
log2(q) + log2(n) + 2 times before it succeeds or fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prefixscore.engine.loop.batcher import Call
from prefixscore.engine.loop.work_unit import WorkUnit

# a failed call over at most this many queries retries each query alone rather than in halves
ONE_BY_ONE = 4


@dataclasses.dataclass(frozen=True)
class Piece:
    """Items first .. first + count - 1 of a request (a root unit, never a piece) to score again."""

    root: WorkUnit
    first: int
    count: int


@dataclasses.dataclass
class Retry:
    """Work retried together, in calls of its own: pieces of scored work, and queued units
    (over a query the failed call wrote) that ride with them."""

    pieces: list[Piece]
    queued: list[WorkUnit]


@dataclasses.dataclass
class Verdict:
    culprits: list[WorkUnit]  # root units whose work failed alone: they fail
    retries: list[Retry]


def root(unit: WorkUnit) -> WorkUnit:
    return unit.lineage.parent if unit.lineage.parent is not None else unit


def pieces_of(call: Call) -> list[Piece]:
    """The call's unfinished work, as pieces of root units."""
    out = []
    for span in call.plan.spans:
        unit = span.ref
        # rows of a query's own prefill: its unit stays queued until they are all back, and is
        # retried as queued work over the query the call wrote
        if span.prefix or unit.progress.finished or root(unit).progress.finished:
            continue
        out.append(Piece(root(unit), unit.lineage.parent_first + span.first, span.count))
    return out


def reads(unit: WorkUnit) -> set[int]:
    """id() of the prefix entries whose pages the unit's work reads: its query's, and its
    lenders' (the chain its query borrows or copies leading tokens from)."""
    out, entry = set(), unit.pin.entry
    while entry is not None:
        out.add(id(entry))
        entry = entry.lender
    return out


def _key(unit: WorkUnit) -> int:
    """Work over one query shares its pages: it is retried, and found at fault, together."""
    return id(unit.pin.entry) if unit.pin.entry is not None else id(root(unit))


def by_query(pieces: Sequence[Piece], queued: Sequence[WorkUnit] = ()) -> list[Retry]:
    """The work grouped by the query it reads, in order of first appearance."""
    by_key: dict[int, Retry] = {}
    for piece in pieces:
        by_key.setdefault(_key(piece.root), Retry([], [])).pieces.append(piece)
    for unit in queued:
        by_key.setdefault(_key(unit), Retry([], [])).queued.append(unit)
    return list(by_key.values())


def judge(call: Call, pieces: Sequence[Piece], queued: Sequence[WorkUnit]) -> Verdict:
    """What follows from `call` failing. pieces: its unfinished work (pieces_of); queued:
    units still queued over a query the call wrote (their pages are prefilled again)."""
    retries = by_query(pieces, queued)
    if call.group is None or len(retries) > 1:
        if len(retries) > ONE_BY_ONE:  # two halves by query
            half = len(retries) // 2
            retries = [_merge(retries[:half]), _merge(retries[half:])]
        return Verdict([], retries)
    if not retries:
        return Verdict([], [])
    # a call of one query's work alone failed
    (alone,) = retries
    items = sum(p.count for p in alone.pieces)
    if items > 1:
        first, second = _halves(alone.pieces, items // 2)
        return Verdict([], [Retry(first, alone.queued), Retry(second, [])])
    if items == 1:  # one item failed alone: its request; the others over the query try again alone
        return Verdict([alone.pieces[0].root], [Retry([], alone.queued)] if alone.queued else [])
    # no item: the query's prefill failed alone, and so does everything waiting on it
    return Verdict(list({id(root(u)): root(u) for u in alone.queued}.values()), [])


def _merge(retries: list[Retry]) -> Retry:
    return Retry([p for r in retries for p in r.pieces], [u for r in retries for u in r.queued])


def _halves(pieces: list[Piece], at: int) -> tuple[list[Piece], list[Piece]]:
    """The pieces' items split after the first `at` (0 < at < all)."""
    first: list[Piece] = []
    second: list[Piece] = []
    for piece in pieces:
        take = max(0, min(piece.count, at))
        if take:
            first.append(Piece(piece.root, piece.first, take))
        if piece.count > take:
            second.append(Piece(piece.root, piece.first + take, piece.count - take))
        at -= take
    return first, second
