"""Plan one device call: where every token sits, as the typed host arrays the engine ships as is.

Pure host code (numpy), no device. A call (model/step.py) has two regions:

- the **prefill region** [Tp], identical on every device: prefill chunks of new
  queries back to back. Each chunk is its own segment (its query's pages, prefix =
  where the chunk starts) and one causal item; its K/V is written into the pool
  layer by layer, before any token of the call reads the pool, so a later chunk of
  the same query, and the query's items, may sit in the same call.
- the **item region** [devices, Ti]: items grouped into one contiguous segment per
  query per device (the query's pages, prefix = the query's length); whole
  sequences (item_first, the sequential baseline) in segment 0, which has no prefix.

Each row (item) carries its own label set and softmax flag, so requests with
different labels share a call. Segment starts sit at multiples of the attention
implementation's SEGMENT_ALIGN, so a kernel's query block never meets two
segments; the gap before an aligned start continues the previous segment.

`CallBuilder` takes work in priority order and says whether it still fits the
largest call; `build()` picks the smallest buckets that hold what was taken and
lays it out. Shapes come only from buckets (`CallShape`, the executable key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np

from prefixscore.model.buckets import Buckets

# label sets per call: rows index into a [LABEL_SETS, labels] table of the call
LABEL_SETS = 16


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The executable key: every shape of a call's inputs follows from it and the buckets."""

    prefill_tokens: int  # Tp: the prefill region (0: none)
    item_tokens: int  # Ti: the item region, per device
    rows: int  # R: items per device
    labels: int  # L: label ids per call (the union of its rows' label sets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillRegion:
    """Prefill chunks, the same on every device. All [Tp] int32."""

    tokens: Any
    positions: Any
    segment_ids: Any  # the chunk's segment (page-table row)
    item_ids: Any  # one causal item per chunk (padding: a unique id per token)
    write_pages: Any  # the pool page each token's K/V goes to (pool pages: padding, dropped)
    write_offsets: Any  # and the slot within that page


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ItemRegion:
    """Items, one stream per device (leading axis: devices)."""

    tokens: Any  # [d, Ti] int32
    positions: Any  # [d, Ti] int32: prefix_len + index within the item
    segment_ids: Any  # [d, Ti] int32
    item_ids: Any  # [d, Ti] int32
    read_at: Any  # [d, R] int32: the stream index (prefill region included) of each row's last token
    label_set: Any  # [d, R] int32: row of label_sets
    apply_softmax: Any  # [d, R] bool
    n_rows: Any  # [d] int32: rows in use
    max_item_len: Any  # [d] int32: the longest item (a hint for the causal part)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CallInputs:
    """Everything a device call reads besides the weights and the pool."""

    prefill: PrefillRegion
    items: ItemRegion
    page_table: Any  # [S, P] int32: pool pages of each segment
    prefix_len: Any  # [S] int32
    labels: Any  # [L] int32: the call's label ids
    label_sets: Any  # [LABEL_SETS, L] int32: per set, indices into labels (-1: unused)
    max_chunk_len: Any  # [] int32: the longest prefill chunk


@dataclasses.dataclass(frozen=True)
class PlannedRow:
    ref: Any  # the caller's handle for the item
    row: int  # its row in the call's output [devices * R, L]
    labels: int  # how many label columns are its own


@dataclasses.dataclass(frozen=True)
class CallPlan:
    shape: CallShape
    inputs: CallInputs  # numpy arrays, shipped as they are
    rows: tuple[PlannedRow, ...]
    chunks: int  # prefill chunks in the call
    prefill_tokens: int  # real tokens of the prefill region
    item_tokens: int  # real tokens of the item region
    device_tokens: int  # tokens the call computes (every device; padding included)


@dataclasses.dataclass
class _Item:
    tokens: Sequence[int]
    label_set: int
    softmax: bool
    ref: Any


@dataclasses.dataclass
class _Segment:
    key: Hashable
    pages: Sequence[int]
    prefix_len: int
    items: list[_Item] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Chunk:
    pages: Sequence[int]
    tokens: Sequence[int]
    start: int


def align_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Layout:
    """Greedy placement of segments' items into device streams, in segment order.

    A run is one segment's items on one device; it starts at an aligned offset. A device
    closes when the next item does not fit its tokens or rows. Runs are what take
    page-table rows (segment 0 runs need none)."""

    def __init__(self, devices: int, capacity: int, rows: int, align: int) -> None:
        self.devices, self.capacity, self.max_rows, self.align = devices, capacity, rows, align
        self.placed: list[list[tuple[int, int]]] = [[]]  # per device, in stream order: (segment, offset)
        self.used = 0
        self.rows = 0
        self.runs = 0  # runs of segments other than 0
        self.last: int | None = None  # segment of the device's last run

    def _start(self, seg_index: int, n: int) -> int | None:
        """Where an item of n tokens of this segment would start on the current device (None:
        it needs the next device)."""
        start = self.used if self.last == seg_index else align_up(self.used, self.align)
        if start + n > self.capacity or self.rows + 1 > self.max_rows:
            return None
        return start

    def fits(self, seg_index: int, n: int, needs_row: bool) -> tuple[bool, int]:
        """Whether the item fits after everything placed, and the runs that would add."""
        if self._start(seg_index, n) is not None:
            return True, int(needs_row and self.last != seg_index)
        return len(self.placed) < self.devices and n <= self.capacity, int(needs_row)

    def add(self, seg_index: int, n: int, needs_row: bool) -> bool:
        start = self._start(seg_index, n)
        if start is None:
            if len(self.placed) == self.devices or n > self.capacity:
                return False
            self.placed.append([])
            self.used = self.rows = 0
            self.last = None
            start = 0
        if self.last != seg_index and needs_row:
            self.runs += 1
        self.placed[-1].append((seg_index, start))
        self.used = start + n
        self.rows += 1
        self.last = seg_index
        return True


class CallBuilder:
    """Collects one call's work in priority order (see module doc)."""

    def __init__(self, buckets: Buckets, devices: int, align: int, pool_pages: int) -> None:
        self.b = buckets
        self.devices = devices
        self.align = align
        self.pool_pages = pool_pages
        self.chunks: list[_Chunk] = []
        self.prefill_used = 0
        # segment 0: whole sequences over no prefix (first in the stream when it has items)
        self.segments: list[_Segment] = [_Segment(None, (), 0)]
        self._by_key: dict[Hashable, int] = {}
        self.labels: list[int] = []
        self.label_sets: list[tuple[int, ...]] = []
        self.item_capacity = buckets.max_batch_tokens
        self.closed = False  # an item longer than max_batch_tokens has the call to itself
        self._layout = self._new_layout(self.item_capacity)

    def _new_layout(self, capacity: int) -> _Layout:
        return _Layout(self.devices, capacity, self.b.rows(capacity), self.align)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.items

    @property
    def items(self) -> int:
        return sum(len(s.items) for s in self.segments)

    def _slots_free(self, extra_runs: int = 0, extra_chunks: int = 0) -> bool:
        """Page-table rows: row 0 (no prefix), one per chunk, one per run of a segment."""
        return 1 + len(self.chunks) + extra_chunks + self._layout.runs + extra_runs <= self.b.segments

    def add_chunk(self, pages: Sequence[int], tokens: Sequence[int], start: int) -> bool:
        """A prefill chunk (<= prefill_chunk tokens) of a query whose first `start` tokens are
        already written (in an earlier call, or by an earlier chunk of this one)."""
        if self.closed or len(tokens) > self.b.prefill_chunk:
            return False
        at = align_up(self.prefill_used, self.align)
        if at + len(tokens) > self.b.prefill[-1] or not self._slots_free(extra_chunks=1):
            return False
        self.chunks.append(_Chunk(pages, tokens, start))
        self.prefill_used = at + len(tokens)
        return True

    def _label_set(self, label_ids: tuple[int, ...]) -> tuple[int, list[int]] | None:
        """The set's index, and the label ids new to the call; None if the call has no room."""
        if label_ids in self.label_sets:
            return self.label_sets.index(label_ids), []
        new = [t for t in dict.fromkeys(label_ids) if t not in self.labels]
        if len(self.label_sets) == LABEL_SETS or len(self.labels) + len(new) > self.b.labels[-1]:
            return None
        return len(self.label_sets), new

    def add_item(
        self,
        key: Hashable,
        pages: Sequence[int],
        prefix_len: int,
        tokens: Sequence[int],
        label_ids: tuple[int, ...],
        apply_softmax: bool,
        ref: Any,
    ) -> bool:
        """An item over the prefix `key` (pages, prefix_len); prefix_len 0: a whole sequence."""
        if self.closed:
            return False
        n = len(tokens)
        if n > self.item_capacity:
            if not self.empty or n > self.b.tokens[-1]:
                return False
            # a long item or sequence runs alone, in the stream bucket that holds it
            self.item_capacity = Buckets.fit(self.b.tokens, n, "item tokens")
            self._layout = self._new_layout(self.item_capacity)
            self.closed = True
        labels = self._label_set(label_ids)
        if labels is None:
            return False
        seg_index = 0 if prefix_len == 0 else self._by_key.get(key, len(self.segments))
        last = seg_index == len(self.segments) or seg_index == self._layout.last
        if last:  # appended after everything placed: O(1)
            ok, runs = self._layout.fits(seg_index, n, prefix_len > 0)
            if not (ok and self._slots_free(extra_runs=runs)):
                return False
            trial = None
        else:  # an earlier segment grows: place everything again
            trial = self._place(self.item_capacity, extra=(seg_index, n))
            if trial is None:
                return False
        set_index, new_labels = labels
        if set_index == len(self.label_sets):
            self.label_sets.append(label_ids)
        self.labels += new_labels
        if seg_index == len(self.segments):
            self.segments.append(_Segment(key, pages, prefix_len))
            self._by_key[key] = seg_index
        self.segments[seg_index].items.append(_Item(tokens, set_index, apply_softmax, ref))
        if trial is None:
            self._layout.add(seg_index, n, prefix_len > 0)
        else:
            self._layout = trial
        return True

    # ---- the plan ---------------------------------------------------------------------------
    def _buckets(self) -> tuple[int, int, _Layout]:
        """The smallest prefill and item-region buckets that hold what was taken, and the layout."""
        b = self.b
        tp = Buckets.fit(b.prefill, self.prefill_used, "prefill tokens") if self.chunks else 0
        candidates = [t for t in b.tokens if t <= self.item_capacity]
        if tp:
            candidates = [t for t in candidates if t <= b.max_batch_tokens]
        for ti in candidates:
            layout = self._place(ti)
            if layout is not None:
                return tp, ti, layout
        raise RuntimeError("the planned items do not fit the call they were admitted to")  # add_item checked

    def fill(self) -> tuple[int, int]:
        """(real tokens, device tokens) the call would have: its padding, before building it."""
        tp, ti, _ = self._buckets()
        real = sum(len(c.tokens) for c in self.chunks) + sum(len(it.tokens) for s in self.segments for it in s.items)
        return real, self.devices * (tp + ti)

    def build(self) -> CallPlan:
        """Lay out what was taken in the smallest buckets that hold it."""
        b, d = self.b, self.devices
        tp, ti, layout = self._buckets()
        rows = b.rows(ti)
        labels_bucket = Buckets.fit(b.labels, max(1, len(self.labels)), "label_token_ids")
        shape = CallShape(tp, ti, rows, labels_bucket)
        table = np.zeros((b.segments, b.max_pages), np.int32)
        prefix_len = np.zeros(b.segments, np.int32)
        slot = 1  # row 0: no prefix
        prefill = self._prefill_region(tp, table, prefix_len, slot)
        slot += len(self.chunks)
        items, planned, slot = self._item_region(layout, shape, table, prefix_len, slot)
        label_ids = np.zeros(labels_bucket, np.int32)
        label_ids[: len(self.labels)] = self.labels
        where = {t: i for i, t in enumerate(self.labels)}
        label_sets = np.full((LABEL_SETS, labels_bucket), -1, np.int32)
        for i, ids in enumerate(self.label_sets):
            label_sets[i, : len(ids)] = [where[t] for t in ids]
        inputs = CallInputs(
            prefill=prefill,
            items=items,
            page_table=table,
            prefix_len=prefix_len,
            labels=label_ids,
            label_sets=label_sets,
            max_chunk_len=np.int32(max((len(c.tokens) for c in self.chunks), default=1)),
        )
        item_tokens = sum(len(it.tokens) for s in self.segments for it in s.items)
        return CallPlan(
            shape=shape,
            inputs=inputs,
            rows=tuple(planned),
            chunks=len(self.chunks),
            prefill_tokens=sum(len(c.tokens) for c in self.chunks),
            item_tokens=item_tokens,
            device_tokens=d * (tp + ti),
        )

    def _place(self, ti: int, extra: tuple[int, int] | None = None) -> _Layout | None:
        """Every segment's items placed into device streams of ti tokens, in segment order (with
        one more item of `extra` = (segment, tokens)); None when they do not fit."""
        lay = self._new_layout(ti)
        for i, seg in enumerate(self.segments):
            lengths = [len(it.tokens) for it in seg.items]
            if extra is not None and extra[0] == i:
                lengths.append(extra[1])
            for n in lengths:
                if not lay.add(i, n, seg.prefix_len > 0):
                    return None
        if 1 + len(self.chunks) + lay.runs > self.b.segments:
            return None
        return lay

    def _prefill_region(self, tp: int, table: np.ndarray, prefix_len: np.ndarray, slot: int) -> PrefillRegion:
        pt = self.b.page_tokens
        tokens = np.zeros(tp, np.int32)
        positions = np.zeros(tp, np.int32)
        segment_ids = np.zeros(tp, np.int32)
        item_ids = -1 - np.arange(tp, dtype=np.int32)  # padding: one item per token
        write_pages = np.full(tp, self.pool_pages, np.int32)  # out of the pool: dropped
        write_offsets = np.zeros(tp, np.int32)
        at = 0
        for c, chunk in enumerate(self.chunks):
            start = align_up(at, self.align)
            segment_ids[at:start] = segment_ids[at - 1] if at else 0  # the gap continues the last chunk
            n = len(chunk.tokens)
            where = slice(start, start + n)
            pos = chunk.start + np.arange(n, dtype=np.int32)
            tokens[where] = chunk.tokens
            positions[where] = pos
            segment_ids[where] = slot + c
            item_ids[where] = c
            write_pages[where] = np.asarray(chunk.pages, np.int32)[pos // pt]
            write_offsets[where] = pos % pt
            table[slot + c, : len(chunk.pages)] = chunk.pages
            prefix_len[slot + c] = chunk.start
            at = start + n
        # the tail up to the next aligned index continues the last chunk; beyond it, no prefix
        tail = min(align_up(at, self.align), tp)
        if at:
            segment_ids[at:tail] = segment_ids[at - 1]
        return PrefillRegion(tokens, positions, segment_ids, item_ids, write_pages, write_offsets)

    def _item_region(
        self, layout: _Layout, shape: CallShape, table: np.ndarray, prefix_len: np.ndarray, slot: int
    ) -> tuple[ItemRegion, list[PlannedRow], int]:
        d, ti, r = self.devices, shape.item_tokens, shape.rows
        tokens = np.zeros((d, ti), np.int32)
        positions = np.zeros((d, ti), np.int32)
        segment_ids = np.zeros((d, ti), np.int32)
        item_ids = np.broadcast_to(-1 - np.arange(ti, dtype=np.int32), (d, ti)).copy()
        read_at = np.zeros((d, r), np.int32)
        label_set = np.zeros((d, r), np.int32)
        softmax = np.zeros((d, r), bool)
        n_rows = np.zeros(d, np.int32)
        max_len = np.ones(d, np.int32)
        planned: list[PlannedRow] = []
        cursor = {i: 0 for i in range(len(self.segments))}  # next item of each segment
        for dev, placed in enumerate(layout.placed):
            run_slot: dict[int, int] = {}
            end = 0
            for row, (seg_index, start) in enumerate(placed):
                seg = self.segments[seg_index]
                item = seg.items[cursor[seg_index]]
                cursor[seg_index] += 1
                if seg.prefix_len and seg_index not in run_slot:
                    run_slot[seg_index] = slot
                    table[slot, : len(seg.pages)] = seg.pages
                    prefix_len[slot] = seg.prefix_len
                    slot += 1
                seg_row = run_slot.get(seg_index, 0)
                segment_ids[dev, end:start] = segment_ids[dev, end - 1] if end else 0  # alignment gap
                n = len(item.tokens)
                where = slice(start, start + n)
                tokens[dev, where] = item.tokens
                positions[dev, where] = seg.prefix_len + np.arange(n, dtype=np.int32)
                segment_ids[dev, where] = seg_row
                item_ids[dev, where] = row
                read_at[dev, row] = shape.prefill_tokens + start + n - 1
                label_set[dev, row] = item.label_set
                softmax[dev, row] = item.softmax
                max_len[dev] = max(max_len[dev], n)
                planned.append(PlannedRow(item.ref, dev * r + row, len(self.label_sets[item.label_set])))
                end = start + n
            tail = min(align_up(end, self.align), ti)
            if end:
                segment_ids[dev, end:tail] = segment_ids[dev, end - 1]
            n_rows[dev] = len(placed)
        region = ItemRegion(tokens, positions, segment_ids, item_ids, read_at, label_set, softmax, n_rows, max_len)
        return region, planned, slot
