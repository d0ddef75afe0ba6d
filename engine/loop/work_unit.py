"""The device loop's unit of work: one entry of its queue, which carries its own reply.

A unit is one unary request, one batch of a stream, or (no items) a stream's query to
prefill. Producers (the service's threads) build units and submit them; the one consumer,
the device thread, plans calls from the queue (engine/loop/batcher.py) and fills each unit's
reply in place, then hands the unit to its `on_done`.

Its fields are grouped by what they hold and who writes them:

- `payload`: what to score (the validated request); set by the producer, never changed;
- `ticket`: who asked, and by when; set by the producer;
- `reply`: the answer (scores, cached tokens, or an error) and where it goes; written on
  the device thread, read by `on_done`'s receiver;
- `pin`: the query's pages held for the unit (engine/loop/page_pins.py);
- `progress`: where it stands in the queue (the batcher's order and items taken; finished);
- `lineage`: the isolation of failed calls (engine/loop/isolation.py): a retried piece's request,
  the group it may ride in only with, a request's pieces still out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.runtime.prefix_cache import CachedPrefix


@dataclasses.dataclass(frozen=True)
class Ticket:
    """Who asked, and by when: set when the unit is built."""

    method: str = "Score"  # metrics label of the RPC this work belongs to
    request_id: str = ""  # the client's request id, for the log when its work fails
    deadline: float | None = None  # time.monotonic() after which queued items are dropped
    created: float = dataclasses.field(default_factory=time.monotonic)
    counts_lookup: bool = True  # counts as a prefix-cache hit or miss (stream batches do not: their open did)


def _no_receiver(unit: WorkUnit) -> None:
    """The reply of a unit nobody waits for (a retried piece: its scores are its request's)."""


@dataclasses.dataclass(eq=False)
class Reply:
    """The answer, filled on the device thread: `on_done(unit)` runs once (through the worker's
    `deliver` hook: on the server's event loop) when every item is scored (or, without items,
    the query's prefill is launched) or the unit failed (`error` set); never after
    `DeviceWorker.cancel(unit)`."""

    # the request's answer, as its kind fills it (engine/requests/answers.py): label scores [items, labels],
    # token rows [item tokens, TOKEN_COLUMNS], pooled hidden states [items, hidden]
    answer: np.ndarray
    remaining: int  # items whose rows have not come back
    on_done: Callable[[WorkUnit], None] = _no_receiver
    cached_tokens: int = 0  # prefix tokens served from the prefix cache
    first_scores_at: float | None = None  # time.monotonic() when its first scores came back
    error: BaseException | None = None
    # a request reading rows of its own query: those not come back yet (a query prefilled again
    # after a failed call gives some twice)
    rows_due: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))


@dataclasses.dataclass(eq=False)
class QueryPin:
    """The unit's hold on its query's pages in the prefix pool."""

    entry: CachedPrefix | None = None  # the query's pages (None: item_first, no prefix)
    released: bool = False  # the pin was given back (a retried piece never holds one: its request does)


@dataclasses.dataclass(eq=False)
class Progress:
    """Where the unit stands: its place in the queue (the batcher's) and its end (the worker's)."""

    seq: int = 0  # arrival order
    taken: int = 0  # items handed to device calls (in order)
    cancelled: bool = False  # its queued items left the queue
    finished: bool = False  # answered or failed (or cancelled): nothing more is delivered


@dataclasses.dataclass(eq=False)
class Lineage:
    """Isolation of failed calls (engine/loop/isolation.py): a retried piece is `parent`'s items from
    `parent_first` on (its scores are the parent's; the parent holds the pin)."""

    parent: WorkUnit | None = None
    parent_first: int = 0
    group: int | None = None  # the isolation group a call may carry it only with
    pieces: list[WorkUnit] = dataclasses.field(default_factory=list)  # a request's retried pieces still out


@dataclasses.dataclass(eq=False)
class WorkUnit:
    """Items that are answered together; see the module doc. The reply's answer is shaped by
    the payload's kind (engine/requests/answers.py)."""

    payload: TokenizedRequest
    ticket: Ticket = dataclasses.field(default_factory=Ticket)
    reply: Reply = dataclasses.field(init=False)
    pin: QueryPin = dataclasses.field(default_factory=QueryPin)
    progress: Progress = dataclasses.field(default_factory=Progress, init=False)
    lineage: Lineage = dataclasses.field(default_factory=Lineage)

    def __post_init__(self) -> None:
        payload = self.payload
        due = payload.answers_due
        self.reply = Reply(payload.answer.buffer(payload.items, len(payload.label_ids)), due)
        if payload.prefix_rows is not None:
            self.reply.rows_due = np.ones(due, bool)

    @property
    def queued(self) -> int:
        """Items not yet in a device call."""
        return 0 if self.progress.cancelled else len(self.payload.items) - self.progress.taken

    @property
    def tokens(self) -> int:
        """Item tokens of the unit (the query's are prefilled once, not per item)."""
        return self.payload.items.total

    @property
    def queued_tokens(self) -> int:
        """Item tokens not yet in a device call."""
        offsets = self.payload.items.offsets
        return 0 if self.progress.cancelled else int(offsets[-1] - offsets[self.progress.taken])
