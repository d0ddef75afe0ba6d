"""The device loop's side of a failed device call.

engine/isolation.py decides which work a failed call takes down and which is retried; this
carries it out on the loop's state: a pool the call consumed (it is donated) is made anew,
the pages the call wrote are prefilled again (their epoch moves on), the culprits fail, and
the retried work is queued as isolation groups (engine/batcher.py plans a group alone).
Results of a call launched before a rewrite of a query it read are not trusted: that work
is retried too. Failed calls are counted in a row, none succeeding between them: past
MAX_FAILED_CALLS_IN_A_ROW the device is taken for broken and the loop stops.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

from prefixscore.engine import isolation
from prefixscore.engine.batcher import Batcher, Call
from prefixscore.engine.loop_metrics import LoopMetrics
from prefixscore.engine.planner import CallPlan
from prefixscore.engine.prefix_cache import PrefixCache
from prefixscore.engine.scoring_engine import ScoringEngine
from prefixscore.engine.work_unit import Lineage, QueryPin, WorkUnit

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

    def succeeded(self) -> None:
        """A call came back: the device works."""
        self.failed_in_a_row = 0

    def count_failure(self) -> bool:
        """One more call failed; whether calls keep failing (the device is taken for broken)."""
        self.metrics.failed_call()
        self.failed_in_a_row += 1
        return self.failed_in_a_row > MAX_FAILED_CALLS_IN_A_ROW

    def recover(self, call: Call, err: BaseException) -> None:
        """`call` failed with `err`: its work is retried in calls of its own, and the requests
        whose work failed alone fail (engine/isolation.py)."""
        engine, batcher, cache = self.engine, self.batcher, self.cache
        if engine.pool_lost():  # every query's pages went with it
            engine.reset_pool()
            cache.rewrite_all()
        for entry in call.written:  # what it wrote may be garbage: prefilled again
            cache.rewrite(entry)
        rewritten = {id(entry) for entry in call.written}
        # work queued over a rewritten query rides with the retry (its new prefill is isolated
        # too), unless it is retried already: a group of its own is isolated as it is, and drawing
        # it into this call's retry would bring a co-rider back beside the culprit at every failure
        # (the retries never converge: every call that prefills the query again fails)
        queued = [
            u
            for u in batcher.live_units()
            if u.lineage.group is None and u.pin.entry is not None and id(u.pin.entry) in rewritten
        ]
        verdict = isolation.judge(call, isolation.pieces_of(call), queued)
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
        """Queue `retry`'s work as one isolation group (engine/batcher.py)."""
        group = next(self._groups)
        for unit in retry.queued:
            unit.lineage.group = group
        for piece in retry.pieces:
            request = piece.root
            payload = dataclasses.replace(request.payload, items=request.payload.items.rows(piece.first, piece.count))
            unit = WorkUnit(
                payload,
                dataclasses.replace(request.ticket, counts_lookup=False),
                pin=QueryPin(request.pin.entry, released=True),  # the request holds the pin
                lineage=Lineage(request, piece.first, group),
            )
            request.lineage.pieces.append(unit)
            self.batcher.add(unit)
        self._wake()
