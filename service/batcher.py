"""The batcher: pending items from all in-flight requests and streams, grouped so that
items which can share one device call do.

A device call scores items over one prefix KV with one set of label ids and one
softmax flag. So pending items are grouped by `GroupKey` (prefix token ids,
label ids, apply_softmax, item_first), first come first served within a group.
`next_batch` picks the group holding the oldest pending item, hands a window of
that group's oldest items (from every request of the group) to the engine's
planner (`ScoringEngine.plan`), and takes the planner's first device call: that
is where requests sharing a query merge into one device batch. Whatever the
call could not hold stays queued, in order, for the next one.

Pure Python and not thread-safe: the device worker calls it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

# (prefix token ids, label token ids, apply_softmax, item_first)
GroupKey = tuple[tuple[int, ...], tuple[int, ...], bool, bool]
# lengths, sequence -> planned device calls (objects with `.indices` into lengths), fullest first
Planner = Callable[[Sequence[int], bool], Sequence[Any]]


@dataclasses.dataclass(eq=False)
class WorkUnit:
    """Items that are answered together: one unary request, or one batch of a stream.

    items: token ids per item (for item_first, whole sequences start + item + query).
    The worker fills `scores` [len(items), len(label_ids)] float32 and calls
    `on_done(unit)` once, from the worker thread, when every item is scored or
    the unit failed (`error` set); never after `DeviceWorker.cancel(unit)`.
    """

    prefix: tuple[int, ...]
    items: list[list[int]]
    label_ids: tuple[int, ...]
    apply_softmax: bool
    item_first: bool
    on_done: Callable[[WorkUnit], None] = lambda unit: None
    method: str = "Score"  # metrics label of the RPC this work belongs to
    counts_lookup: bool = True  # counts as a prefix-cache hit or miss (stream batches do not: their open did)
    deadline: float | None = None  # time.monotonic() after which queued items are dropped
    created: float = dataclasses.field(default_factory=time.monotonic)
    # filled in by the batcher and the worker
    scores: np.ndarray = dataclasses.field(init=False)
    remaining: int = dataclasses.field(init=False)  # items not yet scored
    queued: int = dataclasses.field(init=False)  # items not yet in a device batch
    cached_tokens: int = 0  # prefix tokens served from the prefix cache
    first_scores_at: float | None = None
    error: BaseException | None = None
    cancelled: bool = False
    finished: bool = False

    def __post_init__(self) -> None:
        self.scores = np.zeros((len(self.items), len(self.label_ids)), np.float32)
        self.remaining = len(self.items)
        self.queued = len(self.items)

    @property
    def key(self) -> GroupKey:
        return (self.prefix, self.label_ids, self.apply_softmax, self.item_first)


# one queued item: (arrival sequence number, unit, index into unit.items)
Entry = tuple[int, WorkUnit, int]


@dataclasses.dataclass(eq=False)
class Group:
    """Pending items of one GroupKey, oldest first."""

    key: GroupKey
    pending: collections.deque[Entry] = dataclasses.field(default_factory=collections.deque)
    state: object = None  # the worker's data for the group (the prefix KV); None until resolved
    waiting: list[WorkUnit] = dataclasses.field(default_factory=list)  # units that joined before `state`

    @property
    def prefix(self) -> tuple[int, ...]:
        return self.key[0]

    @property
    def item_first(self) -> bool:
        return self.key[3]

    def head(self) -> int | None:
        """Sequence number of the oldest live pending item (dropping cancelled ones), or None."""
        while self.pending and self.pending[0][1].cancelled:
            self.pending.popleft()
        return self.pending[0][0] if self.pending else None


@dataclasses.dataclass
class Batch:
    """One device call: entries (unit, item index) of one group, and the planner's shape for them."""

    group: Group
    entries: list[tuple[WorkUnit, int]]
    shape: Any  # the planned call (engine BatchShape: .batch rows x .length tokens, .tokens real)

    @property
    def items(self) -> list[list[int]]:
        return [unit.items[i] for unit, i in self.entries]

    @property
    def tokens(self) -> int:
        """Real tokens of the batch's items."""
        return sum(len(unit.items[i]) for unit, i in self.entries)


class Batcher:
    """Groups pending items and forms device batches (see module doc).

    planner: the engine's `plan(lengths, sequence)`; window: how many of a group's
    oldest items are offered to it per call (at least what one device call holds).
    """

    def __init__(self, planner: Planner, window: int) -> None:
        self.planner = planner
        self.window = window
        self.groups: dict[GroupKey, Group] = {}
        self.depth = 0  # items pending (not yet in a device batch), the autoscaling signal
        self._seq = itertools.count()

    def add(self, unit: WorkUnit) -> Group:
        """Queue all of `unit`'s items; returns its group (state None: the worker must resolve it)."""
        group = self.groups.get(unit.key)
        if group is None:
            group = self.groups[unit.key] = Group(unit.key)
        if group.state is None:
            group.waiting.append(unit)
        else:
            unit.cached_tokens = len(unit.prefix)  # the group's prefix KV is already on the device
        group.pending.extend((next(self._seq), unit, index) for index in range(len(unit.items)))
        self.depth += len(unit.items)
        return group

    def cancel(self, unit: WorkUnit) -> None:
        """Drop `unit`'s queued items (lazily: its entries are skipped when reached)."""
        unit.cancelled = True
        self.depth -= unit.queued
        unit.queued = 0

    def unresolved(self) -> list[Group]:
        return [g for g in self.groups.values() if g.state is None]

    def ready(self) -> bool:
        """Whether next_batch would return a batch."""
        return any(g.state is not None and g.head() is not None for g in self.groups.values())

    def live_units(self) -> Iterator[WorkUnit]:
        """Every unit with queued items (each once)."""
        seen: set[int] = set()
        for group in self.groups.values():
            for _, unit, _ in group.pending:
                if not unit.cancelled and id(unit) not in seen:
                    seen.add(id(unit))
                    yield unit

    def next_batch(self) -> Batch | None:
        """Take the next device call from the group with the oldest pending item; None when nothing is ready."""
        best: tuple[int, Group] | None = None
        for group in self.groups.values():
            if group.state is None:
                continue  # its prefix is not on the device yet
            head = group.head()
            if head is not None and (best is None or head < best[0]):
                best = (head, group)
        if best is None:
            return None
        group = best[1]
        window: list[Entry] = []
        for entry in group.pending:
            if not entry[1].cancelled:
                window.append(entry)
                if len(window) == self.window:
                    break
        shape = self.planner([len(unit.items[i]) for _, unit, i in window], group.item_first)[0]
        chosen = {window[i][0] for i in shape.indices}
        # keep the rest in arrival order (cancelled entries go now too)
        group.pending = collections.deque(e for e in group.pending if e[0] not in chosen and not e[1].cancelled)
        entries = []
        for seq, unit, index in window:
            if seq in chosen:
                entries.append((unit, index))
                unit.queued -= 1
        self.depth -= len(entries)
        return Batch(group, entries, shape)

    def prune(self) -> list[Group]:
        """Remove and return groups with nothing pending (the worker releases their prefix)."""
        empty = [g for g in self.groups.values() if g.state is not None and g.head() is None]
        for group in empty:
            del self.groups[group.key]
        return empty
