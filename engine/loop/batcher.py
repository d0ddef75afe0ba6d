"""The batcher: pending work of all in-flight requests and streams, and the choice of what the
next device call carries.

A device call holds prefill chunks of new queries and items of any number of queries
(engine/runtime/planner.py). `next_call` offers the planner's `CallBuilder` pending work in
priority order and plans the call once; what the call could not hold stays queued.

Priority: earliest deadline first, where a request without a deadline counts as due
DEFAULT_SLACK_S after it arrived (so none waits forever behind deadline traffic), then
arrival. Fairness: a first pass offers each request at most an equal share of the
call's item tokens, a second pass offers the rest in priority order, so a small request
behind a large one rides in the next call instead of after all of the large one.
A request's query is prefilled (its chunks placed) before its items are offered; its
items may ride in the call that carries its last chunk. A request that reads rows of its own
query (`prefix_rows`: a prompt scored whole) gets them from its query's chunks, whichever
request's work places them (a borrower's places its lender's first); it is answered when they
have all come back.

Isolation: work retried after a failed device call (engine/loop/isolation.py) carries a
group (`lineage.group`); a call carries one group's work and nothing else, the oldest group first, so a
request that makes calls fail can fail only the calls it rides in alone.

The queue's entries are WorkUnits (engine/loop/work_unit.py), each carrying its own reply; the
one consumer, the device thread, plans the calls. Pure Python and not thread-safe: the device
worker calls it under its lock.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.runtime.buckets import Buckets, ceil_div
from prefixscore.engine.runtime.planner import CallBuilder, CallPlan, ChunkRows, Extent
from prefixscore.engine.runtime.prefix_cache import CachedPrefix

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


class PlanFailed(Exception):
    """Planning a call raised: nothing of it was committed (every unit is as it was queued).
    `units`: the units the failed fill had taken work of, in order; `unit`: the one whose offer
    raised (the last of them), or None when building the filled call raised."""

    def __init__(self, units: list[WorkUnit], unit: WorkUnit | None, err: BaseException) -> None:
        super().__init__(f"planning a call failed: {type(err).__name__}: {err}")
        self.units, self.unit = units, unit


def due(unit: WorkUnit) -> float:
    """When the unit is due: its deadline, or DEFAULT_SLACK_S after it arrived."""
    deadline = unit.ticket.deadline
    return deadline if deadline is not None else unit.ticket.created + DEFAULT_SLACK_S


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
    admitted_seqs: list[int] = dataclasses.field(default_factory=list)  # units that got chunks or items, in order
    # after the k-th admission of the fair pass (index k - 1): what a fill limited to k units can
    # reach. Such a fill is this one's fair pass up to there, then a second pass that only adds
    bounds: list[_Bound] = dataclasses.field(default_factory=list)

    @property
    def admitted(self) -> int:
        return len(self.admitted_seqs)


class Batcher:
    """Pending units and the planning of calls (see module doc).

    new_builder: an empty CallBuilder for the engine's shapes; chunk: prefill chunk length.
    """

    def __init__(self, new_builder: Callable[[], CallBuilder], chunk: int) -> None:
        self.new_builder = new_builder
        self.chunk = chunk
        self.units: dict[int, WorkUnit] = {}  # seq -> unit, in arrival order
        self._row_readers: dict[int, WorkUnit] = {}  # id(entry) -> the unit reading its prefill's rows
        self._seq = itertools.count()
        # kept as units come and go: admission reads them at every request
        self.depth = 0  # items pending (not yet in a device call): the autoscaling signal
        self.queued_tokens = 0  # their tokens (admission control counts tokens as well as items)

    def add(self, unit: WorkUnit) -> None:
        unit.progress.seq = next(self._seq)
        self.units[unit.progress.seq] = unit
        self.depth += unit.queued
        self.queued_tokens += unit.queued_tokens
        entry = unit.pin.entry
        if unit.payload.prefix_rows is not None and entry is not None:
            self._row_readers[id(entry)] = unit

    def cancel(self, unit: WorkUnit) -> None:
        """Drop `unit`'s queued items (and its query's rows: no one reads them any more)."""
        if self.units.get(unit.progress.seq) is unit:
            self.depth -= unit.queued
            self.queued_tokens -= unit.queued_tokens
            del self.units[unit.progress.seq]
        entry = unit.pin.entry
        if entry is not None and self._row_readers.get(id(entry)) is unit:
            del self._row_readers[id(entry)]
        unit.progress.cancelled = True

    def live_units(self) -> Iterator[WorkUnit]:
        return iter([u for u in self.units.values() if not u.progress.cancelled])

    def ready(self, opens_only: bool = False) -> bool:
        """Whether next_call would plan a call."""
        return any(
            self._needs_device(u) and not (opens_only and not u.payload.prefill_only) for u in self.units.values()
        )

    @staticmethod
    def _needs_device(unit: WorkUnit) -> bool:
        entry = unit.pin.entry
        return unit.queued > 0 or (entry is not None and not entry.ready and not unit.payload.items)

    def prefilled(self) -> list[WorkUnit]:
        """Prefill-only units whose query is fully written (by launched calls): done; removed."""
        done = [
            u for u in self.units.values() if u.payload.prefill_only and u.pin.entry is not None and u.pin.entry.ready
        ]
        for unit in done:
            del self.units[unit.progress.seq]
        return done

    def next_call(self, opens_only: bool = False) -> Call | None:
        """Plan the next device call from all pending work (`opens_only`: only the prefills of
        opening streams); None when there is none.

        The call is filled in priority order; when that leaves it padded past PADDING_GOAL (its
        tokens fall just past a bucket), fills that stop a few requests earlier are tried too
        and the best-filled one that keeps most of the work is taken, and then one in the next
        smaller item bucket (`_fuller`). Lower-priority requests only ever wait for the next call."""
        pending = sorted(
            (
                u
                for u in self.units.values()
                if self._needs_device(u) and not (opens_only and not u.payload.prefill_only)
            ),
            key=lambda u: (due(u), u.progress.seq),
        )
        if not pending:
            return None
        groups = [u.lineage.group for u in pending if u.lineage.group is not None]
        group = min(groups) if groups else None  # the oldest isolation group goes alone, first
        pending = [u for u in pending if u.lineage.group == group]
        if group is not None and any(not u.payload.items for u in pending):
            # a group's prefills go first, alone (engine/loop/recovery.py): one that fails is found at once
            pending = [u for u in pending if not u.payload.items]
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
        if best_share < 1 - PADDING_GOAL:
            best = self._fuller(pending, best, full_real)
        try:
            plan = best.builder.build()
        except Exception as err:
            raise PlanFailed([self.units[seq] for seq in best.admitted_seqs], None, err) from err
        for entry, upto in best.written.values():
            entry.written = upto
        for seq, took in best.offered.items():
            unit = self.units[seq]
            before = unit.queued_tokens
            unit.progress.taken += took
            self.depth -= took
            self.queued_tokens -= before - unit.queued_tokens
        for unit in pending:
            if unit.payload.items and unit.queued == 0:
                del self.units[unit.progress.seq]  # all its items are in calls; the worker delivers them
        return Call(plan, [entry for entry, _ in best.written.values()], group)

    def _fuller(self, pending: list[WorkUnit], best: _Fill, work: int) -> _Fill:
        """`best`, or the same work in the next smaller item bucket, filled (a request split where
        it stops), when that and the rest of `work` (real tokens) run in fewer device tokens: the
        rest counted as a call of its own in the smallest bucket that holds it, the most it costs
        when nothing else comes to share it."""
        b, devices = best.builder.b, best.builder.devices
        smaller = [t for t in b.tokens if t < best.builder.item_bucket]
        if not smaller or best.builder.closed:
            return best

        def cost(fill: _Fill) -> int:
            real, device = fill.builder.fill()
            rest = ceil_div(work - real, devices)
            return device + (devices * Buckets.fit(b.tokens, min(rest, b.tokens[-1]), "item tokens") if rest > 0 else 0)

        trial = self._fill(pending, None, smaller[-1])
        if trial.builder.empty or trial.builder.fill()[0] < TRIM_KEEP * work:
            return best
        return trial if cost(trial) < cost(best) else best

    def _fill(self, pending: list[WorkUnit], limit: int | None, item_tokens: int | None = None) -> _Fill:
        """Offer pending work to a new builder in priority order; `limit`: at most this many
        units get anything; `item_tokens`: the item region it fills (a smaller bucket than
        max_batch_tokens). Mutates nothing but the builder (next_call commits)."""
        builder = self.new_builder()
        if item_tokens is not None:
            builder.limit_items(item_tokens)
        fill = _Fill(builder)
        capacity = builder.item_capacity * builder.devices
        share = max(1, capacity // max(1, sum(1 for u in pending if u.queued)))
        prefilling = sum(1 for u in pending if u.pin.entry is not None and not u.pin.entry.ready)
        prefill_share = max(self.chunk, builder.b.prefill[-1] // max(1, prefilling))
        admitted: set[int] = set()
        left_over = 0  # tokens the units admitted so far could still add in the second pass
        for fair in (True, False):
            refusals = 0
            for unit in pending:
                if refusals >= MAX_REFUSALS:
                    break
                seq = unit.progress.seq
                if limit is not None and seq not in admitted and len(admitted) >= limit:
                    continue
                chunks = len(builder.chunks)
                try:
                    ready = self._prefill(builder, unit, fill.written, prefill_share if fair else None)
                    took, refused = (0, False)
                    if ready:
                        took, refused = self._offer(builder, unit, fill.offered.get(seq, 0), share if fair else None)
                except Exception as err:  # isolated by the device loop (engine/loop/recovery.py), as a failed call
                    taken = [self.units[s] for s in fill.admitted_seqs if s != seq]
                    raise PlanFailed([*taken, unit], unit, err) from err
                fill.offered[seq] = fill.offered.get(seq, 0) + took
                if took or len(builder.chunks) > chunks:
                    if fair and seq not in admitted:
                        left_over += self._left_over(unit, fill, took)
                        real = builder.real_tokens
                        fill.bounds.append(_Bound(real, real + left_over, builder.extent()))
                    if seq not in admitted:
                        fill.admitted_seqs.append(seq)
                        admitted.add(seq)
                refusals = refusals + 1 if refused else 0
        return fill

    @staticmethod
    def _left_over(unit: WorkUnit, fill: _Fill, took: int) -> int:
        """Tokens of `unit` that its first-pass offer left: its query's chunks not placed and its
        items not taken."""
        offsets = unit.payload.items.offsets
        items = int(offsets[-1] - offsets[unit.progress.taken + took])  # a pending unit is never cancelled
        entry = unit.pin.entry
        chunks = len(entry.tokens) - fill.written[id(entry)][1] if entry is not None else 0
        return items + chunks

    def _prefill(
        self, builder: CallBuilder, unit: WorkUnit, written: dict[int, tuple[CachedPrefix, int]], share: int | None
    ) -> bool:
        """Place the unit's query chunks not yet written (up to `share` tokens: a long query
        does not hold up every new short one); whether its items may follow in this call."""
        entry = unit.pin.entry
        if entry is None:
            return True
        return self._write(builder, entry, len(entry.tokens), written, share)

    def _write(
        self,
        builder: CallBuilder,
        entry: CachedPrefix,
        end: int,
        written: dict[int, tuple[CachedPrefix, int]],
        share: int | None,
    ) -> bool:
        """Place what launched calls (and this fill) do not write yet of the entry's tokens up to
        `end`: first what its lender holds for it (a failed call left it to rewrite, or its prefill
        has not run), then its copy of the lender's tokens with its first chunk, then its chunks
        (up to `share` tokens); whether they reach `end`."""
        start = upto = written.get(id(entry), (entry, entry.written))[1]
        lender = entry.lender
        if lender is not None and upto < end and not self._write(builder, lender, entry.copied, written, share):
            written[id(entry)] = (entry, upto)  # nothing of its own placed yet
            return False
        if upto < entry.copied:  # the copy rides with the first chunk: a call with a prefill region applies it
            assert lender is not None
            size = min(self.chunk, len(entry.tokens) - entry.copied)
            first = entry.tokens[entry.copied : entry.copied + size]
            rows = self._chunk_rows(entry, entry.copied, size)
            if not builder.copy_room(entry.copied - upto) or not builder.add_chunk(
                entry.pages, first, entry.copied, rows
            ):
                written[id(entry)] = (entry, upto)
                return False
            builder.add_copy(lender.pages, entry.pages, upto, entry.copied)
            upto = entry.copied + size
        while upto < end:
            size = min(self.chunk, end - upto)
            if share is not None and upto > start and upto - start + size > share:
                break
            if not builder.add_chunk(
                entry.pages, entry.tokens[upto : upto + size], upto, self._chunk_rows(entry, upto, size)
            ):
                break
            upto += size
        written[id(entry)] = (entry, upto)
        return upto >= end

    def _chunk_rows(self, entry: CachedPrefix, start: int, size: int) -> ChunkRows | None:
        """The rows a chunk of `entry` (tokens start .. start + size - 1) gives the unit reading its
        prefill's rows, if any: those of its positions from the unit's prefix_rows on."""
        unit = self._row_readers.get(id(entry))
        if unit is None:
            return None
        first, end, tokens = unit.payload.prefix_rows, start + size, entry.tokens
        assert first is not None
        if end <= first:
            return None
        lo = max(start, first)
        targets = np.zeros(end - lo, np.int32)  # each the next token; after the prefix's last, none
        after = tokens[lo + 1 : end + 1]
        targets[: len(after)] = after
        return ChunkRows(unit, lo - first, lo - start, targets, unit.payload.answer.output)

    @staticmethod
    def _offer(builder: CallBuilder, unit: WorkUnit, already: int, share: int | None) -> tuple[int, bool]:
        """Offer the unit's next items in order (up to `share` tokens, at least one item);
        (items taken, refused: the call could not hold what was offered)."""
        payload = unit.payload
        first = unit.progress.taken + already
        count = len(payload.items) - first
        if count <= 0:
            return 0, False
        offsets = payload.items.offsets
        if int(offsets[first + 1] - offsets[first]) > builder.b.tokens[-1]:
            # no compiled shape holds its next item yet (a staged warm-up is under way): it waits
            # for its stage without counting as a refusal, so it holds up no one behind it
            return 0, False
        # a request needing up to twice its share goes whole: split, it would cost the call a second
        # run (a page-table row, a kernel block) and leave the next call a few of its items
        if share is not None and int(offsets[-1] - offsets[first]) > SPLIT_PAST * share:
            ends = offsets[first + 1 :] - offsets[first]
            count = max(1, int(np.searchsorted(ends, share, side="right")))
        entry = unit.pin.entry
        took = builder.add_items(
            id(entry) if entry is not None else None,
            entry.pages if entry is not None else (),
            len(entry.tokens) if entry is not None else 0,
            payload.items,
            first,
            count,
            payload.label_ids,
            payload.answer.output,
            unit,
            payload.answer.each_token,
        )
        return took, took < count


def take_results(call: Call, out: np.ndarray) -> tuple[list[WorkUnit], list[WorkUnit]]:
    """A finished call's output [devices * R, columns] into its requests' answers, one slice per
    row span (a retried piece's rows go to its request's: engine/loop/isolation.py). Returns (requests
    now complete, requests with a non-finite score: not written, not counted). Requests
    already finished (cancelled while on the device, or failed) are skipped."""
    finite = np.isfinite(out).all(axis=1)  # one pass for the call (unused columns are 0)
    shape = call.plan.shape  # which columns each kind of row reads
    complete: list[WorkUnit] = []
    broken: list[WorkUnit] = []
    for span in call.plan.spans:
        unit = span.ref
        request = unit.lineage.parent if unit.lineage.parent is not None else unit
        if request.progress.finished or unit.progress.finished or request in broken:
            continue
        rows = slice(span.row, span.row + span.rows)
        if not finite[rows].all():
            broken.append(request)
            continue
        first, reply, payload = unit.lineage.parent_first + span.first, request.reply, request.payload
        # the span's own columns, written into the answer as its kind says (engine/requests/answers.py)
        own = out[rows, shape.columns(span.output, span.labels)]
        payload.answer.fill(reply.answer, payload.items, first, span.count, own)
        if span.prefix:  # a query prefilled again (a failed call) gives some rows twice: counted once
            due = reply.rows_due[first : first + span.count]
            reply.remaining -= int(due.sum())
            due[:] = False
        else:
            reply.remaining -= span.count
        if reply.remaining == 0:
            complete.append(request)
    return complete, broken
