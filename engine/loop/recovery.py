"""The device loop's side of a failed device call.

engine/loop/isolation.py decides which work a failed call takes down and which is retried; this
carries it out on the loop's state: a pool the call consumed (it is donated) is made anew,
the pages the call wrote are prefilled again (their epoch moves on), the culprits fail, and
the retried work is queued as isolation groups (engine/loop/batcher.py plans a group alone).
Results of a call launched before a rewrite of a query it read are not trusted: that work
is retried too. Failed calls are counted in a row, none succeeding between them: past
MAX_FAILED_CALLS_IN_A_ROW the device is taken for broken and the loop stops.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

from prefixscore.engine.loop import isolation
from prefixscore.engine.loop.batcher import Batcher, Call, PlanFailed
from prefixscore.engine.loop.loop_metrics import LoopMetrics
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import Lineage, QueryPin, WorkUnit
from prefixscore.engine.runtime.planner import CallPlan
from prefixscore.engine.runtime.prefix_cache import PrefixCache
from prefixscore.engine.runtime.scoring_engine import ScoringEngine

log = logging.getLogger("prefixscore.worker")
# failed device calls in a row, none succeeding between them, after which the device is taken
# for broken: isolating one request's fault takes about log2(queries) + log2(items) failures,
# each between successful calls of the work it cleared
MAX_FAILED_CALLS_IN_A_ROW = 24


def epochs_at_launch(plan: CallPlan) -> dict[int, int]:
    """id(entry) -> its epoch now, for the queries the call's items read (see Recovery.trusted)."""
    entries = (span.ref.pin.entry for span in plan.spans)
    return {id(entry): entry.epoch for entry in entries if entry is not None}


class Recovery:
    """What the device loop does after a failed call; see the module doc.

    finish(unit, error): the worker's, fails a request once; wake(): the worker's, tells the
    loop that work was queued. Called under the worker's lock, but `count_failure`.
    """

    def __init__(
        self,
        engine: ScoringEngine,
        batcher: Batcher,
        cache: PrefixCache,
        metrics: LoopMetrics,
        finish: Callable[[WorkUnit, BaseException], None],
        wake: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.batcher = batcher
        self.cache = cache
        self.metrics = metrics
        self._finish = finish
        self._wake = wake
        self.failed_in_a_row = 0
        self._groups = itertools.count()  # isolation groups, oldest first
        # pools made anew after a failed call took one down: a call launched before the last
        # one ran on the pool that was lost (its own failure is collateral)
        self.pool_generation = 0

    def succeeded(self) -> None:
        """A call came back: the device works."""
        self.failed_in_a_row = 0

    def count_failure(self) -> bool:
        """One more call failed; whether calls keep failing (the device is taken for broken)."""
        self.metrics.failed_call()
        self.failed_in_a_row += 1
        return self.failed_in_a_row > MAX_FAILED_CALLS_IN_A_ROW

    def recover(self, call: Call, err: BaseException, collateral: bool = False) -> None:
        """`call` failed with `err`: its work is retried in calls of its own, and the requests
        whose work failed alone fail (engine/loop/isolation.py). `collateral`: it ran on (or was
        launched onto) a pool that an earlier call took down, so its failure says nothing of its
        work: that is retried as it was, judged by nobody (the earlier call is judged)."""
        engine, batcher, cache = self.engine, self.batcher, self.cache
        if not collateral and engine.pool_lost():  # every query's pages went with it
            engine.reset_pool()
            cache.rewrite_all()
            self.pool_generation += 1
        for entry in call.written:  # what it wrote may be garbage: prefilled again
            cache.rewrite(entry)
        rewritten = {id(entry) for entry in call.written}
        # work queued over a rewritten query (or one it borrows pages from) is part of the failed
        # call's work: its new prefill must be isolated too. Only work of the call's own isolation
        # scope (its group, or ungrouped work for an ungrouped call): work retried in another group
        # is isolated as it is, and drawing it into this retry would bring a co-rider back beside
        # the culprit at every failure (the retries never converge). Work of the call's own group
        # must be drawn in: a stream open's prefill has no items, and left in its group it would be
        # planned, and fail, again and again with nobody to blame.
        queued = [u for u in batcher.live_units() if u.lineage.group == call.group and isolation.reads(u) & rewritten]
        pieces = isolation.pieces_of(call)
        if collateral:
            verdict = isolation.Verdict([], [isolation.Retry(pieces, queued)] if pieces or queued else [])
        else:
            verdict = isolation.judge(call, pieces, queued)
        for culprit in verdict.culprits:
            self.metrics.failed_alone()
            log.error("request %s failed in a device call of its own: %s", culprit.ticket.request_id or "-", err)
            batcher.cancel(culprit)
            self._finish(culprit, err)
        for retry in verdict.retries:
            self._retry(retry)
        ids = sorted({p.root.ticket.request_id or "-" for r in verdict.retries for p in r.pieces})
        if ids:
            log.warning("device call failed; retrying in %d calls of their own: %s", len(verdict.retries), ids)
        self.metrics.cache(cache)
        self.metrics.queue_depth(batcher.depth)

    def plan_failed(self, failure: PlanFailed) -> None:
        """Planning a call raised (nothing of it was committed): the same rule as a failed call's.
        Work planned alone is the culprit; else the unit whose offer raised is planned alone
        next, or (building the call raised) the units the fill had taken go in two halves."""
        units = list({id(u): u for u in failure.units}.values())
        roots = {id(isolation.root(u)) for u in units}
        if len(roots) == 1:
            culprit = isolation.root(units[0])
            self.metrics.failed_alone()
            log.error("request %s failed planning a call of its own: %s", culprit.ticket.request_id or "-", failure)
            for unit in units:
                self.batcher.cancel(unit)
            self._finish(culprit, failure)
        else:
            halves = (
                [[failure.unit]] if failure.unit is not None else [units[: len(units) // 2], units[len(units) // 2 :]]
            )
            for half in halves:
                group = next(self._groups)
                for unit in half:
                    unit.lineage.group = group
            log.warning("planning a call failed; planning its work in %d calls of their own", len(halves))
        self.metrics.queue_depth(self.batcher.depth)

    def trusted(self, call: Call, epochs: dict[int, int]) -> Call:
        """`call` (launched when its queries were at `epochs`) without the spans that read a
        query rewritten since (a failed call before it wrote it): those are retried, not
        delivered."""
        spans = call.plan.spans
        stale = tuple(s for s in spans if (e := s.ref.pin.entry) is not None and epochs[id(e)] != e.epoch)
        if not stale:
            return call
        stale_call = dataclasses.replace(call, plan=dataclasses.replace(call.plan, spans=stale))
        for retry in isolation.by_query(isolation.pieces_of(stale_call)):
            self._retry(retry)
        kept = tuple(s for s in spans if s not in stale)
        return dataclasses.replace(call, plan=dataclasses.replace(call.plan, spans=kept))

    def _retry(self, retry: isolation.Retry) -> None:
        """Queue `retry`'s work as one isolation group (engine/loop/batcher.py). A query of it that
        must be prefilled again gets a prefill of its own in the group (a unit without items),
        which the group's first call carries alone: a prefill that fails is then found at
        fault in one call, not item by item in every call that carries it."""
        group = next(self._groups)
        for unit in retry.queued:
            unit.lineage.group = group
        prefilling = {id(u.pin.entry) for u in retry.queued if not u.payload.items}
        for piece in retry.pieces:
            request = piece.root
            entry = request.pin.entry
            if entry is not None and not entry.ready and id(entry) not in prefilling:
                prefilling.add(id(entry))
                self._add_piece(request, dataclasses.replace(request.payload, items=[]), 0, group)
            items = request.payload.items.rows(piece.first, piece.count)
            self._add_piece(request, dataclasses.replace(request.payload, items=items), piece.first, group)
        self._wake()

    def _add_piece(self, request: WorkUnit, payload: TokenizedRequest, first: int, group: int) -> None:
        """Queue part of `request`'s work (its scores are the request's; the request holds the pin)."""
        unit = WorkUnit(
            payload,
            dataclasses.replace(request.ticket, counts_lookup=False),
            pin=QueryPin(request.pin.entry, released=True),
            lineage=Lineage(request, first, group),
        )
        request.lineage.pieces.append(unit)
        self.batcher.add(unit)
