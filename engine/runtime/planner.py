"""Plan one device call: where every token sits, as the typed host arrays the engine ships as is.

Pure host code (numpy), no device. A call (model/step.py) has two regions:

- the **prefill region** [devices, Tp]: prefill chunks of new queries back to back,
  each on one data replica (the least filled when it is taken). Each chunk is its own
  segment (its query's pages, prefix = where the chunk starts) and one causal item;
  every replica's chunks' K/V is gathered and written into every replica's pool layer
  by layer, before any token of the call reads the pool, so a later chunk of the same
  query (on any replica), and the query's items, may sit in the same call. A query whose
  leading tokens another query's pages hold gets them copied into its own pages, every layer,
  after the writes and before the attention (`add_copy`, beside its first chunk).
- the **item region** [devices, Ti]: items grouped into one contiguous segment per
  query per device (the query's pages, prefix = the query's length); whole
  sequences (item_first, the sequential baseline) in segment 0, which has no prefix.

Each row (item) carries its own label set and output (model/call_inputs.py: the columns it
reads), so requests with different labels share a call. Items whose kind reads every token take
a row per token instead (each_token; a token row's target is the item's next token): a call that
holds such items has one row per token of both regions, and may still carry items of a row each
beside them (at their last token). A prefill chunk may have rows of its own tokens too
(`ChunkRows`: a prompt scored from its own prefill), placed before its replica's item rows. Its
shape says which extra columns its rows return
(CallShape.top_count the outputs it holds; CallShape.hidden, from the buckets). The
planner never asks which kind a request is. Segment starts sit at multiples of the attention
implementation's SEGMENT_ALIGN, so a kernel's query block never meets two
segments; the gap before an aligned start continues the previous segment.

`CallBuilder` takes work in priority order, a request's consecutive items at a
time, and says how many still fit the largest call; each offer is appended after
everything placed (never a re-layout). `build()` picks the smallest buckets that
hold what was taken and lays it out with a few array copies per offer. Shapes
come only from buckets (`CallShape`, the executable key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from prefixscore.engine.runtime.buckets import Buckets, round_up
from prefixscore.engine.runtime.shared_steps import ChunkPlace, StepSharing, shared_steps
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import (
    LABEL_SETS,
    OUTPUT_LOGIT,
    CallInputs,
    CallShape,
    ItemRegion,
    PageCopies,
    PrefillRegion,
)

# whose items a row span holds: the caller's handle (the device loop's unit of work), given with
# the items and handed back with their rows; the planner never looks inside it
Ref = Any


@dataclasses.dataclass(frozen=True)
class RowSpan:
    """Output rows `row` .. `row + rows - 1` are items `first` .. `first + count - 1` of `ref`:
    results are split per span (an array slice), not per item. A span of items that read every
    token has a row per token of its items (rows: their tokens); else a row per item (rows == count).
    A span of prefix rows (`prefix`: a prefill chunk's own tokens, ChunkRows) is rows `first` ..
    `first + count - 1` of `ref`'s prefix rows (rows == count)."""

    ref: Ref  # whose items these are: the batcher's unit, which carries its reply
    first: int
    count: int
    row: int  # the first row in the call's output [devices * R, columns]
    labels: int  # how many label columns are its own
    rows: int
    output: int  # model/call_inputs.py OUTPUT_*: which of the call's columns are its own (CallShape.columns)
    prefix: bool = False


@dataclasses.dataclass(frozen=True)
class ChunkRows:
    """Rows of a prefill chunk's own tokens, from its token `skip` on: each reads its token and
    targets `targets` (the prefix's next token; 0 after its last), returns `output` (its request's
    kind declares which: model/call_inputs.py OUTPUT_*), and comes back as prefix row `first`
    onward of `ref`."""

    ref: Ref
    first: int
    skip: int
    targets: np.ndarray  # [rows] int32
    output: int


@dataclasses.dataclass(frozen=True)
class Extent:
    """How far a call being filled reaches: its buckets can be no smaller (one device)."""

    prefill_tokens: int  # the prefill region's tokens in use (alignment gaps included)
    item_tokens: int  # the item stream's tokens in use
    rows: int  # item rows in use


@dataclasses.dataclass(frozen=True)
class CallPlan:
    shape: CallShape
    inputs: CallInputs  # numpy arrays, shipped as they are
    spans: tuple[RowSpan, ...]
    items: int  # rows in use over all devices
    chunks: int  # prefill chunks in the call
    prefill_tokens: int  # real tokens of the prefill region
    item_tokens: int  # real tokens of the item region
    device_tokens: int  # the call's buckets: its tokens on every device, padding included
    computed_tokens: int  # tokens whose per-token work runs (tokens_run): device_tokens less skipped tiles


def tokens_run(item_ids: np.ndarray, tile: int | None) -> int:
    """Tokens whose per-token work (projections, norms, MLP) a call runs, from its streams' item
    ids [devices, Tp + Ti] (padding: negative): every token, or with a per-token tile (a CPU's) the
    tiles that hold a chunk's or an item's token; model/decoder.py `per_tile` skips the others."""
    d, t = item_ids.shape
    if tile is None or t % tile:
        return d * t
    return int((item_ids.reshape(d, t // tile, tile) >= 0).any(axis=2).sum()) * tile


@dataclasses.dataclass
class _Chunk:
    pages: Sequence[int]
    tokens: Sequence[int]
    start: int  # the query position of its first token
    replica: int  # the data replica whose prefill stream holds it
    at: int  # where it starts in that stream
    rows: ChunkRows | None = None


@dataclasses.dataclass
class _Offer:
    """Consecutive items of one request over one prefix, taken into the call together."""

    seg: int  # the prefix's segment in this call (0: whole sequences, no prefix)
    pages: Sequence[int]
    prefix_len: int
    rows: TokenRows  # the request's items; this offer is rows first .. first + count - 1
    first: int
    count: int
    label_set: int
    output: int  # model/call_inputs.py OUTPUT_*
    each_token: bool  # a row per token of each item (else one, at its last token)
    ref: Ref  # whose items


@dataclasses.dataclass
class _Piece:
    """The part of an offer that sits on one device: `count` items from `first`, starting at
    token `start` of the device's stream and at its row `row`."""

    offer: _Offer
    first: int
    count: int
    device: int
    start: int
    row: int
    tokens: int
    rows: int


class _Layout:
    """Offers placed into device streams in the order they come, each appended after
    everything placed: O(1) array operations per offer and device, never a re-layout.

    A run is consecutive items of one segment on one device; it starts at an aligned offset
    and takes a page-table row (segment 0 needs none). Items of a segment that follow its
    own last run continue it; elsewhere they open a new run. A device closes when the next
    item does not fit its tokens or rows."""

    def __init__(self, devices: int, capacity: int, rows: int, align: int) -> None:
        self.devices, self.capacity, self.max_rows, self.align = devices, capacity, rows, align
        self.pieces: list[_Piece] = []
        self.device = 0
        self.used = 0  # tokens of the current device's stream in use
        self.rows = 0  # rows of the current device in use
        self.runs = 0  # runs that take a page-table row
        self.last: int | None = None  # segment of the current device's last run

    def place(self, offer: _Offer, ends: np.ndarray, row_ends: np.ndarray, row_budget: int) -> int:
        """Place the offer's items in order, from the current device on, while they fit.
        ends: [count] the cumulative tokens of its items; row_ends: [count] their cumulative
        rows (1 an item, or its tokens: token rows); row_budget: page-table rows the layout may
        hold. Returns how many items were placed."""
        taken, n = 0, len(ends)
        while taken < n:
            continues = self.last == offer.seg
            opens_run = offer.seg != 0 and not continues
            if opens_run and self.runs + 1 > row_budget:
                break  # no page-table row left (on another device it would need one too)
            start = self.used if continues else round_up(self.used, self.align)
            base = int(ends[taken - 1]) if taken else 0
            row_base = int(row_ends[taken - 1]) if taken else 0
            room, rows_left = self.capacity - start, self.max_rows - self.rows
            if int(ends[-1]) - base <= room:  # the common case: all the rest fits
                k = n - taken
            else:
                k = int(np.searchsorted(ends[taken:], base + room, side="right"))
            if k and int(row_ends[taken + k - 1]) - row_base > rows_left:
                k = int(np.searchsorted(row_ends[taken : taken + k], row_base + rows_left, side="right"))
            if k == 0:
                if self.device + 1 == self.devices or not (self.used or self.rows):
                    break  # no device left, or the item does not fit an empty one
                if offer.seg != 0 and self.runs + 1 > row_budget:
                    break  # the next device's run would need a page-table row
                self.device += 1
                self.used = self.rows = 0
                self.last = None
                continue
            tokens = int(ends[taken + k - 1]) - base
            rows = int(row_ends[taken + k - 1]) - row_base
            self.pieces.append(_Piece(offer, offer.first + taken, k, self.device, start, self.rows, tokens, rows))
            self.used = start + tokens
            self.rows += rows
            self.runs += opens_run
            self.last = offer.seg
            taken += k
        return taken


def _row_ends(ends: np.ndarray, each_token: bool) -> np.ndarray:
    """Cumulative rows of items whose cumulative tokens are `ends`: a row per token, or one per item."""
    return ends if each_token else np.arange(1, len(ends) + 1)


class CallBuilder:
    """Collects one call's work in priority order (see module doc)."""

    def __init__(
        self,
        buckets: Buckets,
        devices: int,
        align: int,
        pool_pages: int,
        token_tile: int | None,
        sharing: StepSharing | None = None,
    ) -> None:
        self.b = buckets
        self.devices = devices
        self.token_tile = token_tile  # the executables' per-token tile (None: every token computed)
        self.align = align
        self.sharing = sharing  # the attention's shared key steps (None: it shares none)
        self.pool_pages = pool_pages
        self.chunks: list[_Chunk] = []
        self.copies: list[tuple[int, int, int, int]] = []  # (from page, offset, to page, offset) per slot
        self._copy_sources: dict[tuple[int, int], tuple[int, int]] = {}  # a slot this call copies into -> from
        self._prefill_ends = [0] * devices  # each replica's prefill stream, used so far
        self.prefill_real = 0
        self.offers: list[_Offer] = []
        self.items = 0
        self.item_real = 0
        self._segments: dict[Hashable, int] = {}  # prefix key -> segment (1, 2, ...)
        self.labels: list[int] = []
        self.label_sets: list[tuple[int, ...]] = []
        self.item_capacity = buckets.max_batch_tokens
        self.token_rows = False  # a row per item token (the call holds likelihood or mean-pooled items)
        # the row kinds taken (OUTPUT_*): a call with token rows returns their columns (the hidden
        # columns are the buckets': every call of an engine serving embeddings returns them)
        self.outputs: set[int] = set()
        self.closed = False  # an item longer than max_batch_tokens has the call to itself
        self._layout = self._new_layout(self.item_capacity)
        self._choice: tuple[int, int, _Layout] | None = None  # the buckets, once chosen

    def limit_items(self, tokens: int) -> None:
        """Fill at most `tokens` item tokens per device, a bucket below max_batch_tokens (the
        batcher's fuller call: what does not fit waits for the next); before anything is added."""
        assert self.empty, "the item capacity is set before any work"
        self.item_capacity = tokens
        self._layout = self._new_layout(tokens)

    @property
    def item_bucket(self) -> int:
        """The item region's bucket the call would have (per device)."""
        return self._buckets()[1]

    def _new_layout(self, capacity: int) -> _Layout:
        return _Layout(self.devices, capacity, self.b.rows(capacity, self.token_rows), self.align)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.offers

    @property
    def prefill_used(self) -> int:
        """The longest replica's prefill stream: what the prefill bucket must hold."""
        return max(self._prefill_ends)

    def _row_budget(self) -> int:
        """Page-table rows left for runs: row 0 is no prefix, one per chunk."""
        return self.b.segments - 1 - len(self.chunks)

    def add_chunk(self, pages: Sequence[int], tokens: Sequence[int], start: int, rows: ChunkRows | None = None) -> bool:
        """A prefill chunk (<= prefill_chunk tokens) of a query whose first `start` tokens are
        already written (in an earlier call, or by an earlier chunk of this one); with `rows`, rows
        of its own tokens (a call with them has a row per token of the call: CallShape.rows)."""
        if self.closed or len(tokens) > self.b.prefill_chunk:
            return False
        if rows is not None and self.b.token_logprobs_wait:
            return False  # its shapes are not compiled yet: it waits for their warm-up stage
        # the least filled replica: each runs only its own chunks, so a call's prefill work
        # is divided between them (its K/V is gathered for every replica's pool write)
        replica = min(range(self.devices), key=self._prefill_ends.__getitem__)
        at = round_up(self._prefill_ends[replica], self.align)
        if at + len(tokens) > self.b.prefill[-1] or self._layout.runs + 1 > self._row_budget():
            return False
        self.chunks.append(_Chunk(pages, tokens, start, replica, at, rows))
        self._prefill_ends[replica] = at + len(tokens)
        self.prefill_real += len(tokens)
        if rows is not None:
            self._token_rows()
            self.outputs.add(rows.output)
        self._choice = None
        return True

    def _token_rows(self) -> None:
        """A row per item-region token from now on: more rows, the same layout."""
        self.token_rows = True
        self._layout.max_rows = self.b.rows(self._layout.capacity, True)

    def copy_room(self, slots: int) -> bool:
        """Whether the call can copy `slots` more pool slots (PageCopies)."""
        return not self.closed and len(self.copies) + slots <= self.b.copy_slots

    def add_copy(self, from_pages: Sequence[int], to_pages: Sequence[int], start: int, end: int) -> None:
        """Copy positions start .. end - 1 of one query's pages into another's (the same
        positions: a query's leading tokens that another holds), in a call with a prefill region
        (the copy rides with the receiving query's first chunk); after copy_room."""
        pt = self.b.page_tokens
        assert self.chunks and self.copy_room(end - start)
        for p in range(start, end):
            # the call's copies run as one gather and one scatter: a slot another copy of this call
            # fills (a chain of borrowers, planned together) is read from where that copy reads
            source = (from_pages[p // pt], p % pt)
            source = self._copy_sources.get(source, source)
            self._copy_sources[to_pages[p // pt], p % pt] = source
            self.copies.append((*source, to_pages[p // pt], p % pt))

    def _label_set(self, label_ids: tuple[int, ...]) -> tuple[int, list[int]] | None:
        """The set's index, and the label ids new to the call; None if the call has no room."""
        if label_ids in self.label_sets:
            return self.label_sets.index(label_ids), []
        new = [t for t in dict.fromkeys(label_ids) if t not in self.labels]
        if len(self.label_sets) == LABEL_SETS or len(self.labels) + len(new) > self.b.labels[-1]:
            return None
        return len(self.label_sets), new

    def add_items(
        self,
        key: Hashable,
        pages: Sequence[int],
        prefix_len: int,
        rows: TokenRows,
        first: int,
        count: int,
        label_ids: tuple[int, ...],
        output: int,
        ref: Ref,
        each_token: bool = False,
    ) -> int:
        """Items first .. first + count - 1 of `rows` over the prefix `key` (pages, prefix_len;
        prefix_len 0: whole sequences), in order, as many as fit, each with a row per token
        (each_token) or one row; returns how many were taken."""
        if self.closed or count <= 0:
            return 0
        if CallShape.reads_hidden(output) and not self.b.hidden:
            raise ValueError("hidden rows need buckets with the hidden columns (Buckets.hidden)")
        if self.b.token_logprobs_wait and CallShape.top_count({output}):
            return 0  # its shapes are not compiled yet: it waits for their warm-up stage
        ends = rows.offsets[first + 1 : first + count + 1] - rows.offsets[first]
        longest_first = int(ends[0])
        if longest_first > self.item_capacity:
            if not self.empty or longest_first > self.b.tokens[-1]:
                return 0
            # a long item or sequence runs alone, in the stream bucket that holds it
            self.item_capacity = Buckets.fit(self.b.tokens, longest_first, "item tokens")
            self._layout = self._new_layout(self.item_capacity)
            self.closed = True
            ends = ends[:1]
        labels = self._label_set(label_ids)
        if labels is None:
            return 0
        set_index, new_labels = labels
        seg = 0 if prefix_len == 0 else self._segments.get(key, len(self._segments) + 1)
        offer = _Offer(seg, pages, prefix_len, rows, first, 0, set_index, output, each_token, ref)
        switched = each_token and not self.token_rows
        if switched:
            self._token_rows()
        taken = self._layout.place(offer, ends, _row_ends(ends, each_token), self._row_budget())
        if not taken:
            if switched:
                self.token_rows = False
                self._layout.max_rows = self.b.rows(self._layout.capacity)
            return 0
        offer.count = taken
        if set_index == len(self.label_sets):
            self.label_sets.append(label_ids)
        self.labels += new_labels
        if seg:
            self._segments.setdefault(key, seg)
        self.offers.append(offer)
        self.outputs.add(output)
        self.items += taken
        self.item_real += int(ends[taken - 1])
        self._choice = None
        return taken

    # ---- the plan ---------------------------------------------------------------------------
    def _buckets(self) -> tuple[int, int, _Layout]:
        """The smallest prefill and item-region buckets that hold what was taken, and its layout;
        chosen once for fill() and build()."""
        if self._choice is not None:
            return self._choice
        b, layout = self.b, self._layout
        tp = Buckets.fit(b.prefill, self.prefill_used, "prefill tokens") if self.chunks else 0
        candidates = [t for t in b.tokens if t <= self.item_capacity and not (tp and t > b.max_batch_tokens)]
        for ti in candidates:
            if self.devices == 1:
                # one stream: the layout does not depend on the bucket, only needs to fit it
                if layout.used <= ti and layout.rows <= b.rows(ti, self.token_rows):
                    self._choice = (tp, ti, layout)
                    return self._choice
                continue
            # several: a smaller bucket spreads the items over the devices differently
            trial = self._new_layout(ti)
            budget = self._row_budget()
            if all(trial.place(o, *self._ends(o), budget) == o.count for o in self.offers):
                self._choice = (tp, ti, trial)
                return self._choice
        raise RuntimeError("the planned items do not fit the call they were admitted to")  # add_items checked

    @staticmethod
    def _ends(offer: _Offer) -> tuple[np.ndarray, np.ndarray]:
        """The offer's cumulative tokens and rows per item."""
        offsets = offer.rows.offsets
        ends = offsets[offer.first + 1 : offer.first + offer.count + 1] - offsets[offer.first]
        return ends, _row_ends(ends, offer.each_token)

    @property
    def real_tokens(self) -> int:
        """Real (not padding) tokens taken so far: prefill chunks and items."""
        return self.prefill_real + self.item_real

    def extent(self) -> Extent:
        """How far the call's regions reach now (cheap: what a later bound is computed from)."""
        return Extent(self.prefill_used if self.chunks else 0, self._layout.used, self._layout.rows)

    def least_device_tokens(self, extent: Extent) -> int | None:
        """The fewest device tokens a call reaching at least `extent` can have: its buckets only
        grow as work is added. None with several devices, where a smaller item bucket spreads the
        items differently (no cheap bound)."""
        if self.devices != 1:
            return None
        b = self.b
        tp = Buckets.fit(b.prefill, extent.prefill_tokens, "prefill tokens") if extent.prefill_tokens else 0
        ti = next(
            (t for t in b.tokens if extent.item_tokens <= t and extent.rows <= b.rows(t, self.token_rows)),
            b.tokens[-1],
        )
        return tp + ti

    def fill(self) -> tuple[int, int]:
        """(real tokens, device tokens) the call would have: its padding, before building it."""
        tp, ti, _ = self._buckets()
        return self.real_tokens, self.devices * (tp + ti)

    def build(self) -> CallPlan:
        """Lay out what was taken in the smallest buckets that hold it."""
        b, d = self.b, self.devices
        tp, ti, layout = self._buckets()
        labels_bucket = Buckets.fit(b.labels, max(1, len(self.labels)), "label_token_ids")
        shape = b.shape(tp, ti, labels_bucket, CallShape.top_count(self.outputs), self.token_rows)
        table = np.zeros((b.segments, b.max_pages), np.int32)
        prefix_len = np.zeros(b.segments, np.int32)
        slot = 1  # row 0: no prefix
        prefill = self._prefill_region(tp, table, prefix_len, slot)
        slot += len(self.chunks)
        items, spans = self._item_region(layout, shape, table, prefix_len, slot)
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
            copies=self._copies(),
        )
        return CallPlan(
            shape=shape,
            inputs=inputs,
            spans=tuple(spans),
            items=self.items,
            chunks=len(self.chunks),
            prefill_tokens=self.prefill_real,
            item_tokens=self.item_real,
            device_tokens=d * (tp + ti),
            computed_tokens=tokens_run(np.concatenate([prefill.item_ids, items.item_ids], axis=1), self.token_tile),
        )

    def _copies(self) -> PageCopies:
        """The call's copies [copy_slots] each; padding to a page out of the pool (dropped)."""
        slots = np.zeros((4, self.b.copy_slots), np.int32)
        slots[2] = self.pool_pages
        if self.copies:
            slots[:, : len(self.copies)] = np.asarray(self.copies, np.int32).T
        return PageCopies(*slots)

    def _prefill_region(self, tp: int, table: np.ndarray, prefix_len: np.ndarray, slot: int) -> PrefillRegion:
        """Each replica's prefill stream [devices, Tp]: its chunks at their places, padding elsewhere."""
        pt, d = self.b.page_tokens, self.devices
        tokens = np.zeros((d, tp), np.int32)
        positions = np.zeros((d, tp), np.int32)
        segment_ids = np.zeros((d, tp), np.int32)
        item_ids = np.broadcast_to(-1 - np.arange(tp, dtype=np.int32), (d, tp)).copy()  # padding: one item a token
        write_pages = np.full((d, tp), self.pool_pages, np.int32)  # out of the pool: dropped
        write_offsets = np.zeros((d, tp), np.int32)
        end = np.zeros(d, np.int64)  # each replica's stream end so far
        places: list[list[ChunkPlace]] = [[] for _ in range(d)]
        for c, chunk in enumerate(self.chunks):
            r, start, n = chunk.replica, chunk.at, len(chunk.tokens)
            if end[r]:  # the alignment gap continues the replica's previous chunk
                segment_ids[r, end[r] : start] = segment_ids[r, end[r] - 1]
            where = slice(start, start + n)
            pos = chunk.start + np.arange(n, dtype=np.int32)
            tokens[r, where] = chunk.tokens
            positions[r, where] = pos
            segment_ids[r, where] = slot + c
            item_ids[r, where] = c
            write_pages[r, where] = np.asarray(chunk.pages, np.int32)[pos // pt]
            write_offsets[r, where] = pos % pt
            table[slot + c, : len(chunk.pages)] = chunk.pages
            prefix_len[slot + c] = chunk.start
            end[r] = start + n
            places[r].append(ChunkPlace(start, n, chunk.start + n, chunk.pages))
        # the tail up to the next aligned index continues the last chunk; beyond it, no prefix
        for r in range(d):
            if end[r]:
                tail = min(round_up(int(end[r]), self.align), tp)
                segment_ids[r, end[r] : tail] = segment_ids[r, end[r] - 1]
        groups = [shared_steps(p, tp, pt, self.sharing) for p in places]
        blocks, count, block_of, steps = (np.stack([g[i] for g in groups]).astype(np.int32) for i in range(4))
        return PrefillRegion(
            tokens, positions, segment_ids, item_ids, write_pages, write_offsets, blocks, count, block_of, steps
        )

    def _item_region(
        self, layout: _Layout, shape: CallShape, table: np.ndarray, prefix_len: np.ndarray, slot: int
    ) -> tuple[ItemRegion, list[RowSpan]]:
        """The item region from the layout's pieces: a few array copies per piece."""
        d, ti, r = self.devices, shape.item_tokens, shape.rows
        tokens = np.zeros((d, ti), np.int32)
        positions = np.zeros((d, ti), np.int32)
        segment_ids = np.zeros((d, ti), np.int32)
        item_ids = np.broadcast_to(-1 - np.arange(ti, dtype=np.int32), (d, ti)).copy()
        read_at = np.zeros((d, r), np.int32)
        label_set = np.zeros((d, r), np.int32)
        # a row no item holds reads nothing; OUTPUT_LOGIT needs no reduction over the vocabulary
        # (OUTPUT_FULL, zero, would make every head step holding a padding row compute one)
        output = np.full((d, r), OUTPUT_LOGIT, np.int8)
        target = np.zeros((d, r), np.int32)
        n_rows = np.zeros(d, np.int32)
        max_len = np.ones(d, np.int32)
        end = np.zeros(d, np.int64)  # each device's stream end so far
        run_of: dict[int, tuple[int, int]] = {}  # device -> (segment, page-table row) of its last run
        spans: list[RowSpan] = []
        # each replica's prefill rows first (a chunk's own tokens' rows), then its items' rows
        base = np.zeros(d, np.int64)
        for chunk in self.chunks:
            if chunk.rows is None:
                continue
            dev, n = chunk.replica, len(chunk.rows.targets)
            rows = slice(int(base[dev]), int(base[dev]) + n)
            read_at[dev, rows] = chunk.at + chunk.rows.skip + np.arange(n)
            target[dev, rows] = chunk.rows.targets
            output[dev, rows] = chunk.rows.output
            spans.append(
                RowSpan(chunk.rows.ref, chunk.rows.first, n, dev * r + int(base[dev]), 0, n, chunk.rows.output, True)
            )
            base[dev] += n
        n_rows[:] = base
        for piece in layout.pieces:
            offer, dev, start = piece.offer, piece.device, piece.start
            seg_row = 0
            if offer.seg:
                last = run_of.get(dev)
                if last is not None and last[0] == offer.seg and end[dev] == start:
                    seg_row = last[1]  # continues the device's last run
                else:
                    seg_row = slot
                    table[slot, : len(offer.pages)] = offer.pages
                    prefix_len[slot] = offer.prefix_len
                    slot += 1
            run_of[dev] = (offer.seg, seg_row)
            if end[dev] < start:  # the alignment gap continues the device's previous run
                segment_ids[dev, end[dev] : start] = segment_ids[dev, end[dev] - 1] if end[dev] else 0
            offsets = offer.rows.offsets
            lo, hi = int(offsets[piece.first]), int(offsets[piece.first + piece.count])
            bounds = offsets[piece.first : piece.first + piece.count + 1]
            ends = bounds[1:] - lo
            lengths = np.diff(bounds)
            where = slice(start, start + piece.tokens)
            first_row = int(base[dev]) + piece.row
            rows = slice(first_row, first_row + piece.rows)
            tokens[dev, where] = offer.rows.flat[lo:hi]
            positions[dev, where] = offer.prefix_len + offer.rows.positions()[lo:hi]
            segment_ids[dev, where] = seg_row
            token_rows = offer.each_token
            # an item's id: its first row (its only one, unless it has a row per token)
            first_rows = first_row + (bounds[:-1] - lo if token_rows else np.arange(piece.count))
            item_ids[dev, where] = np.repeat(first_rows.astype(np.int32), lengths)
            if token_rows:  # every token, targeting the next one of its item (an item's last: none, 0)
                read_at[dev, rows] = shape.prefill_tokens + start + np.arange(piece.tokens)
                next_tokens = np.zeros(piece.tokens, np.int32)
                next_tokens[:-1] = offer.rows.flat[lo + 1 : hi]
                next_tokens[ends - 1] = 0
                target[dev, rows] = next_tokens
            else:
                read_at[dev, rows] = shape.prefill_tokens + start + ends - 1
            label_set[dev, rows] = offer.label_set
            output[dev, rows] = offer.output
            max_len[dev] = max(int(max_len[dev]), int(lengths.max()))
            n_rows[dev] = first_row + piece.rows
            own_labels = len(self.label_sets[offer.label_set])
            spans.append(
                RowSpan(
                    offer.ref,
                    piece.first,
                    piece.count,
                    dev * r + first_row,
                    own_labels,
                    piece.rows,
                    offer.output,
                )
            )
            end[dev] = start + piece.tokens
        for dev in range(d):  # the tail up to the next aligned index continues the last run
            if end[dev]:
                tail = min(round_up(int(end[dev]), self.align), ti)
                segment_ids[dev, end[dev] : tail] = segment_ids[dev, end[dev] - 1]
        region = ItemRegion(
            tokens, positions, segment_ids, item_ids, read_at, label_set, output, target, n_rows, max_len
        )
        return region, spans
