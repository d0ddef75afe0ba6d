"""The batcher: pending work of all in-flight requests and streams, and the choice of what the
next device call carries.

A device call holds prefill chunks of new queries and items of any number of queries
(engine/planner.py). `next_call` offers the planner's `CallBuilder` pending work in
priority order and plans the call once; what the call could not hold stays queued.

Priority: earliest deadline first, where a request without a deadline counts as due
DEFAULT_SLACK_S after it arrived (so none waits forever behind deadline traffic), then
arrival. Fairness: a first pass offers each request at most an equal share of the
call's item tokens, a second pass offers the rest in priority order, so a small request
behind a large one rides in the next call instead of after all of the large one.
A request's query is prefilled (its chunks placed) before its items are offered; its
items may ride in the call that carries its last chunk.

Isolation: work retried after a failed device call (engine/isolation.py) carries a
`group`; a call carries one group's work and nothing else, the oldest group first, so a
request that makes calls fail can fail only the calls it rides in alone.

Pure Python and not thread-safe: the device worker calls it under its lock.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np

from prefixscore.engine import heads
from prefixscore.engine.planner import CallBuilder, CallPlan, Extent
from prefixscore.engine.prefix_cache import CachedPrefix
from prefixscore.engine.token_rows import TokenRows

# a request without a deadline is scheduled as if due this long after it arrived
DEFAULT_SLACK_S = 30.0
# the builder refused this many offers in a row: the call is full enough
MAX_REFUSALS = 8
# the first (fair) pass offers a request its share of the call, or all of its items when they
# are at most this many shares
SPLIT_PAST = 2
# a call more padded than this is also planned with up to TRIM_TRIES fewer requests, keeping
# at least TRIM_KEEP of its real tokens: the best-filled plan runs
PADDING_GOAL = 0.05
TRIM_TRIES = 4
TRIM_KEEP = 0.7


class NonFiniteScores(Exception):
    """A device call returned NaN or Inf for these rows: never answered as OK."""


@dataclasses.dataclass(eq=False)
class WorkUnit:
    """Items that are answered together: one unary request, one batch of a stream, or (no
    items) a stream's query to prefill.

    items: token ids per item (for item_first, whole sequences start + item + query), one
    flat array (lists are converted). The worker fills `scores` [len(items), len(label_ids)]
    float32 and calls `on_done(unit)` once (through its `deliver` hook: on the server's
    event loop) when every item is scored (or, without items, the query's prefill is
    launched) or the unit failed (`error` set); never after `DeviceWorker.cancel(unit)`.
    """

    prefix: tuple[int, ...]
    items: TokenRows
    label_ids: tuple[int, ...]
    apply_softmax: bool
    item_first: bool
    activation: str = ""  # a classifier's, applied to its rows as they come back (engine/heads.py)
    on_done: Callable[[WorkUnit], None] = lambda unit: None
    method: str = "Score"  # metrics label of the RPC this work belongs to
    request_id: str = ""  # the client's request id, for the log when its work fails
    counts_lookup: bool = True  # counts as a prefix-cache hit or miss (stream batches do not: their open did)
    deadline: float | None = None  # time.monotonic() after which queued items are dropped
    created: float = dataclasses.field(default_factory=time.monotonic)
    # filled in by the worker and the batcher
    entry: CachedPrefix | None = None  # the query's pages (None: item_first, no prefix)
    scores: np.ndarray = dataclasses.field(init=False)
    remaining: int = dataclasses.field(init=False)  # items not yet scored
    taken: int = 0  # items handed to device calls (in order)
    seq: int = 0  # arrival order
    cached_tokens: int = 0  # prefix tokens served from the prefix cache
    first_scores_at: float | None = None
    error: BaseException | None = None
    cancelled: bool = False
    finished: bool = False
    released: bool = False  # its pin on `entry` was given back
    # isolation (engine/isolation.py): a retried piece of `parent`'s items from `parent_first` on
    # (its scores are the parent's; the parent holds the pin), and the group a call may carry
    # it only with; a parent's pieces still out
    parent: WorkUnit | None = None
    parent_first: int = 0
    group: int | None = None
    pieces: list[WorkUnit] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.items = TokenRows.coerce(self.items)
        self.scores = np.zeros((len(self.items), len(self.label_ids)), np.float32)
        self.remaining = len(self.items)

    @property
    def queued(self) -> int:
        """Items not yet in a device call."""
        return 0 if self.cancelled else len(self.items) - self.taken

    @property
    def tokens(self) -> int:
        """Item tokens of the unit (the query's are prefilled once, not per item)."""
        return self.items.total

    @property
    def queued_tokens(self) -> int:
        """Item tokens not yet in a device call."""
        offsets = self.items.offsets
        return 0 if self.cancelled else int(offsets[-1] - offsets[self.taken])

    @property
    def due(self) -> float:
        return self.deadline if self.deadline is not None else self.created + DEFAULT_SLACK_S


@dataclasses.dataclass(eq=False)
class Call:
    """One planned device call and what it carries. Its row spans' refs are WorkUnits."""

    plan: CallPlan
    written: list[CachedPrefix]  # prefixes whose chunks the call writes
    group: int | None = None  # the isolation group it carries alone (None: any work)


@dataclasses.dataclass(frozen=True)
class _Bound:
    """What a fill limited to the units admitted so far can reach (see _Fill.bounds)."""

    least_real: int  # real tokens placed so far: the second pass only adds
    most_real: int  # those, plus all that the admitted units left for the second pass
    placed: Extent  # how far what is placed so far reaches: the trial's buckets are no smaller


@dataclasses.dataclass
class _Fill:
    """One way of filling a call: the builder, and what committing it would change."""

    builder: CallBuilder
    written: dict[int, tuple[CachedPrefix, int]] = dataclasses.field(default_factory=dict)  # id(entry) ->
    offered: dict[int, int] = dataclasses.field(default_factory=dict)  # unit seq -> items taken
    admitted: int = 0  # units that got chunks or items
    # after the k-th admission of the fair pass (index k - 1): what a fill limited to k units can
    # reach. Such a fill is this one's fair pass up to there, then a second pass that only adds
    bounds: list[_Bound] = dataclasses.field(default_factory=list)


class Batcher:
    """Pending units and the planning of calls (see module doc).

    new_builder: an empty CallBuilder for the engine's shapes; chunk: prefill chunk length.
    """

    def __init__(self, new_builder: Callable[[], CallBuilder], chunk: int) -> None:
        self.new_builder = new_builder
        self.chunk = chunk
        self.units: dict[int, WorkUnit] = {}  # seq -> unit, in arrival order
        self._seq = itertools.count()
        # kept as units come and go: admission reads them at every request
        self.depth = 0  # items pending (not yet in a device call): the autoscaling signal
        self.queued_tokens = 0  # their tokens (admission control counts tokens as well as items)

    def add(self, unit: WorkUnit) -> None:
        unit.seq = next(self._seq)
        self.units[unit.seq] = unit
        self.depth += unit.queued
        self.queued_tokens += unit.queued_tokens

    def cancel(self, unit: WorkUnit) -> None:
        """Drop `unit`'s queued items."""
        if self.units.get(unit.seq) is unit:
            self.depth -= unit.queued
            self.queued_tokens -= unit.queued_tokens
            del self.units[unit.seq]
        unit.cancelled = True

    def live_units(self) -> Iterator[WorkUnit]:
        return iter([u for u in self.units.values() if not u.cancelled])

    def ready(self, opens_only: bool = False) -> bool:
        """Whether next_call would plan a call."""
        return any(self._needs_device(u) and not (opens_only and u.items) for u in self.units.values())

    @staticmethod
    def _needs_device(unit: WorkUnit) -> bool:
        return unit.queued > 0 or (unit.entry is not None and not unit.entry.ready and not unit.items)

    def prefilled(self) -> list[WorkUnit]:
        """Units without items whose query is fully written (by launched calls): done; removed."""
        done = [u for u in self.units.values() if not u.items and u.entry is not None and u.entry.ready]
        for unit in done:
            del self.units[unit.seq]
        return done

    def next_call(self, opens_only: bool = False) -> Call | None:
        """Plan the next device call from all pending work (`opens_only`: only the prefills of
        opening streams); None when there is none.

        The call is filled in priority order; when that leaves it padded past PADDING_GOAL (its
        tokens fall just past a bucket), fills that stop a few requests earlier are tried too
        and the best-filled one that keeps most of the work is taken. Lower-priority requests
        only ever wait for the next call."""
        pending = sorted(
            (u for u in self.units.values() if self._needs_device(u) and not (opens_only and u.items)),
            key=lambda u: (u.due, u.seq),
        )
        if not pending:
            return None
        groups = [u.group for u in pending if u.group is not None]
        group = min(groups) if groups else None  # the oldest isolation group goes alone, first
        pending = [u for u in pending if u.group == group]
        best = self._fill(pending, None)
        if best.builder.empty:
            return None
        real, device = best.builder.fill()
        full_real, best_share = real, real / device
        for fewer in range(1, TRIM_TRIES + 1):
            limit = best.admitted - fewer
            if best_share >= 1 - PADDING_GOAL or limit < 1:
                break
            if limit <= len(best.bounds):
                # decide from the first fill what the trial's own checks below would surely decide
                bound, keep = best.bounds[limit - 1], TRIM_KEEP * full_real
                if bound.most_real < keep:
                    break
                if bound.least_real >= keep:
                    least_device = best.builder.least_device_tokens(bound.placed)
                    if least_device is not None and bound.most_real / least_device <= best_share:
                        continue  # it cannot fill better
            trial = self._fill(pending, limit)
            real, device = trial.builder.fill()
            if real < TRIM_KEEP * full_real:
                break
            # only a trim: fewer requests must not let one of them take more (fair shares hold)
            if real <= full_real and real / device > best_share:
                best, best_share = trial, real / device
        plan = best.builder.build()
        for entry, upto in best.written.values():
            entry.written = upto
        for seq, took in best.offered.items():
            unit = self.units[seq]
            before = unit.queued_tokens
            unit.taken += took
            self.depth -= took
            self.queued_tokens -= before - unit.queued_tokens
        for unit in pending:
            if unit.items and unit.queued == 0:
                del self.units[unit.seq]  # all its items are in calls; the worker delivers them
        return Call(plan, [entry for entry, _ in best.written.values()], group)

    def _fill(self, pending: list[WorkUnit], limit: int | None) -> _Fill:
        """Offer pending work to a new builder in priority order; `limit`: at most this many
        units get anything. Mutates nothing but the builder (next_call commits)."""
        builder = self.new_builder()
        fill = _Fill(builder)
        capacity = builder.item_capacity * builder.devices
        share = max(1, capacity // max(1, sum(1 for u in pending if u.queued)))
        prefilling = sum(1 for u in pending if u.entry is not None and not u.entry.ready)
        prefill_share = max(self.chunk, builder.b.prefill[-1] // max(1, prefilling))
        admitted: set[int] = set()
        left_over = 0  # tokens the units admitted so far could still add in the second pass
        for fair in (True, False):
            refusals = 0
            for unit in pending:
                if refusals >= MAX_REFUSALS:
                    break
                if limit is not None and unit.seq not in admitted and len(admitted) >= limit:
                    continue
                chunks = len(builder.chunks)
                ready = self._prefill(builder, unit, fill.written, prefill_share if fair else None)
                took, refused = (0, False)
                if ready:
                    took, refused = self._offer(builder, unit, fill.offered.get(unit.seq, 0), share if fair else None)
                    fill.offered[unit.seq] = fill.offered.get(unit.seq, 0) + took
                if took or len(builder.chunks) > chunks:
                    if fair and unit.seq not in admitted:
                        left_over += self._left_over(unit, fill, took)
                        real = builder.real_tokens
                        fill.bounds.append(_Bound(real, real + left_over, builder.extent()))
                    admitted.add(unit.seq)
                refusals = refusals + 1 if refused else 0
        fill.admitted = len(admitted)
        return fill

    @staticmethod
    def _left_over(unit: WorkUnit, fill: _Fill, took: int) -> int:
        """Tokens of `unit` that its first-pass offer left: its query's chunks not placed and its
        items not taken."""
        offsets = unit.items.offsets
        items = int(offsets[-1] - offsets[unit.taken + took])  # a pending unit is never cancelled
        entry = unit.entry
        chunks = len(entry.tokens) - fill.written[id(entry)][1] if entry is not None else 0
        return items + chunks

    def _prefill(
        self, builder: CallBuilder, unit: WorkUnit, written: dict[int, tuple[CachedPrefix, int]], share: int | None
    ) -> bool:
        """Place the unit's query chunks not yet written (up to `share` tokens: a long query
        does not hold up every new short one); whether its items may follow in this call."""
        entry = unit.entry
        if entry is None:
            return True
        start = upto = written.get(id(entry), (entry, entry.written))[1]
        n = len(entry.tokens)
        while upto < n:
            size = min(self.chunk, n - upto)
            if share is not None and upto > start and upto - start + size > share:
                break
            if not builder.add_chunk(entry.pages, entry.tokens[upto : upto + size], upto):
                break
            upto += size
        written[id(entry)] = (entry, upto)
        return upto >= n

    @staticmethod
    def _offer(builder: CallBuilder, unit: WorkUnit, already: int, share: int | None) -> tuple[int, bool]:
        """Offer the unit's next items in order (up to `share` tokens, at least one item);
        (items taken, refused: the call could not hold what was offered)."""
        first = unit.taken + already
        count = len(unit.items) - first
        if count <= 0:
            return 0, False
        offsets = unit.items.offsets
        if int(offsets[first + 1] - offsets[first]) > builder.b.tokens[-1]:
            # no compiled shape holds its next item yet (a staged warm-up is under way): it waits
            # for its stage without counting as a refusal, so it holds up no one behind it
            return 0, False
        # a request needing up to twice its share goes whole: split, it would cost the call a second
        # run (a page-table row, a kernel block) and leave the next call a few of its items
        if share is not None and int(offsets[-1] - offsets[first]) > SPLIT_PAST * share:
            ends = offsets[first + 1 :] - offsets[first]
            count = max(1, int(np.searchsorted(ends, share, side="right")))
        entry = unit.entry
        took = builder.add_items(
            id(entry) if entry is not None else None,
            entry.pages if entry is not None else (),
            len(entry.tokens) if entry is not None else 0,
            unit.items,
            first,
            count,
            unit.label_ids,
            unit.apply_softmax,
            unit,
        )
        return took, took < count


def take_results(call: Call, out: np.ndarray) -> tuple[list[WorkUnit], list[WorkUnit]]:
    """A finished call's output [devices * R, L] into its requests' scores, one slice per row
    span (a retried piece's rows go to its request's: engine/isolation.py). Returns (requests
    now complete, requests with a non-finite score: not written, not counted). Requests
    already finished (cancelled while on the device, or failed) are skipped."""
    finite = np.isfinite(out).all(axis=1)  # one pass for the call (unused columns are 0)
    complete: list[WorkUnit] = []
    broken: list[WorkUnit] = []
    for span in call.plan.spans:
        unit = span.ref
        request = unit.parent if unit.parent is not None else unit
        if request.finished or unit.finished or request in broken:
            continue
        rows = slice(span.row, span.row + span.count)
        if not finite[rows].all():
            broken.append(request)
            continue
        first = unit.parent_first + span.first
        request.scores[first : first + span.count] = heads.activate(out[rows, : span.labels], request.activation)
        request.remaining -= span.count
        if request.remaining == 0:
            complete.append(request)
    return complete, broken
