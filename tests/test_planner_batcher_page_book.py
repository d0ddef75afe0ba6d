"""The batcher and the planner alone (no device): what one call carries, in which order, and
the layout the engine ships (segments, alignment, rows, label sets, page writes)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prefixscore.engine.loop.batcher import Batcher, take_results
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import Ticket, WorkUnit
from prefixscore.engine.requests.answers import label_scores
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.planner import CallBuilder
from prefixscore.engine.runtime.prefix_cache import PoolExhausted, PrefixCache
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import OUTPUT_FULL, OUTPUT_SOFTMAX

BUCKETS = Buckets(context=1024, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=256, page_tokens=128)
POOL_PAGES = 64


def setup(devices: int = 1, align: int = 1, token_tile: int | None = None) -> tuple[Batcher, PrefixCache]:
    cache = PrefixCache(POOL_PAGES, BUCKETS.page_tokens, page_bytes=1)
    batcher = Batcher(lambda: CallBuilder(BUCKETS, devices, align, POOL_PAGES, token_tile), BUCKETS.prefill_chunk)
    return batcher, cache


def unit(cache, prefix=(1, 2, 3), lengths=(3,), labels=(5, 6), softmax=False, item_first=False, **ticket) -> WorkUnit:
    req = TokenizedRequest(tuple(prefix), [[7] * n for n in lengths], tuple(labels), label_scores(softmax), item_first)
    u = WorkUnit(req, Ticket(**ticket))
    if not item_first:
        u.pin.entry, _ = cache.acquire(u.payload.prefix)
    return u


def units_of(call) -> list[WorkUnit]:
    out: list[WorkUnit] = []
    for span in call.plan.spans:
        if span.ref not in out:
            out.append(span.ref)
    return out


def test_requests_of_different_queries_labels_and_options_share_one_call():
    b, cache = setup()
    mix = [
        unit(cache, lengths=(3, 4)),
        unit(cache, prefix=(9,) * 40, lengths=(5,)),
        unit(cache, labels=(5,), softmax=True),
        unit(cache, prefix=(), lengths=(10,), item_first=True),
    ]
    for u in mix:
        b.add(u)
    call = b.next_call()
    assert set(units_of(call)) == set(mix) and call.plan.items == 5
    assert call.plan.chunks == 2  # both new queries prefill in this very call
    assert b.depth == 0 and b.next_call() is None
    inputs = call.plan.inputs
    # label sets per row: (5, 6) and (5,) share the call's label ids
    assert sorted(inputs.labels[:2].tolist()) == [5, 6]
    sets = {tuple(inputs.label_sets[i][inputs.label_sets[i] >= 0]) for i in inputs.items.label_set[0, :5]}
    assert len(sets) == 2


def test_a_call_asks_for_the_vocabulary_s_log_sum_exp_only_when_a_row_of_an_item_needs_it():
    """The head computes a log-sum-exp over the whole vocabulary for a step of rows only when one
    of them returns OUTPUT_FULL: the rows no item holds (a bucket's padding) must not ask for it."""
    b, cache = setup()
    b.add(unit(cache, lengths=(3, 4, 5), softmax=True))
    output = b.next_call().plan.inputs.items.output
    assert output.shape[1] > 3  # rows no item holds
    assert (output[0, :3] == OUTPUT_SOFTMAX).all()
    assert not (output == OUTPUT_FULL).any()
    b.add(unit(cache, lengths=(3,), softmax=False))  # a request that does need it still gets it
    assert (b.next_call().plan.inputs.items.output == OUTPUT_FULL).sum() == 1


@pytest.mark.parametrize("devices", [1, 2])
def test_a_call_counts_the_tokens_its_tiles_compute(devices):
    """computed_tokens: every token of the call's buckets where the per-token work runs whole (an
    accelerator), and with a CPU's tile the tiles that hold a chunk's or an item's token: what
    decoder.per_tile computes over the call's streams, counted from its outputs (a skipped tile's
    are zeros)."""
    import jax.numpy as jnp

    from prefixscore.model.decoder import per_tile

    calls = {}
    for tile in (None, 64):
        b, cache = setup(devices, token_tile=tile)
        b.add(unit(cache, prefix=tuple(range(1, 41)), lengths=(3, 4) * devices))  # 40 prefill tokens
        calls[tile] = b.next_call().plan
    whole, tiled = calls[None], calls[64]
    assert whole.computed_tokens == whole.device_tokens == devices * (256 + 256)
    inputs = tiled.inputs
    streams = np.concatenate([inputs.prefill.item_ids, inputs.items.item_ids], axis=1)  # [devices, Tp + Ti]
    ran = 0
    for ids in streams:
        ones = per_tile(jnp.ones_like, 64, jnp.zeros((1, ids.size, 1)), live=jnp.asarray(ids >= 0)[None])
        ran += int(np.asarray(ones).sum())
    assert tiled.computed_tokens == ran
    # a tile of the prefill and one of the items (a device's item region fills before the next's)
    assert ran == 2 * 64 and tiled.device_tokens == whole.device_tokens


def test_chunks_before_items_and_a_long_query_spans_calls():
    """A 600-token query: five 128-token chunks over three calls (256-token prefill region); its
    items wait for the call holding its last chunk. A short new query behind it gets its share
    of the first call's prefill region, and its items ride in that call."""
    b, cache = setup()
    long_one = unit(cache, prefix=range(600), lengths=(4, 4))
    b.add(long_one)
    short = unit(cache, prefix=(8,) * 10, lengths=(2,))
    b.add(short)
    first = b.next_call()
    assert first.plan.chunks == 2 and long_one.pin.entry.written == 128 and short.pin.entry.ready
    assert units_of(first) == [short]
    second = b.next_call()
    assert second.plan.chunks == 2 and not units_of(second) and long_one.pin.entry.written == 384
    third = b.next_call()
    assert third.plan.chunks == 2 and long_one.pin.entry.written == 600 and units_of(third) == [long_one]
    positions = third.plan.inputs.prefill.positions[0]  # one device: one prefill stream
    assert positions.max() == 599


def test_prefill_chunk_layout_writes_its_pages():
    b, cache = setup(align=128)
    u = unit(cache, prefix=range(200), lengths=(3, 5))
    b.add(u)
    call = b.next_call()
    pre = jax.tree.map(lambda a: a[0], call.plan.inputs.prefill)  # one device: one prefill stream
    pages = u.pin.entry.pages
    real = pre.write_pages < POOL_PAGES
    assert real.sum() == 200  # every query token written once, padding dropped
    np.testing.assert_array_equal(pre.positions[real], np.arange(200))
    np.testing.assert_array_equal(pre.write_pages[real], np.asarray(pages)[np.arange(200) // 128])
    np.testing.assert_array_equal(pre.write_offsets[real], np.arange(200) % 128)
    # the second chunk starts at an aligned index, in its own segment, with the first chunk as prefix
    seg = pre.segment_ids
    assert seg[0] != seg[128] and call.plan.inputs.prefix_len[seg[128]] == 128
    items = call.plan.inputs.items
    assert items.positions[0, :3].tolist() == [200, 201, 202]
    assert items.read_at[0, :2].tolist() == [pre.tokens.shape[0] + 2, pre.tokens.shape[0] + 7]


def test_a_query_copies_what_it_shares_past_whole_pages_beside_its_lender_s_chunk():
    """A query that shares 140 tokens with another borrows the page they fill and has the next 12
    copied into its own page, in the call that writes them (the lender's second chunk) and with
    its own first chunk, which starts after them. A failed call that wrote the lender takes the
    copy with it: both are planned again. A third query borrowing 145 tokens from the borrower (a
    chain), planned in the same call, reads the 12 slots the borrower's copy fills from where that
    copy reads them (a call's copies are one gather and one scatter)."""
    b, cache = setup()
    lender = unit(cache, prefix=range(150), lengths=(2,))
    borrower = unit(cache, prefix=(*range(140), *[9] * 50), lengths=(3,))
    chained = unit(cache, prefix=(*range(140), *[9] * 5, *[8] * 20), lengths=(2,))
    entry, lent, third = borrower.pin.entry, lender.pin.entry, chained.pin.entry
    assert entry.lender is lent and (entry.lent, entry.shared, entry.copied) == (1, 128, 140)
    assert entry.pages[0] == lent.pages[0] and entry.pages[1] != lent.pages[1]
    assert third.lender is entry and (third.lent, third.shared, third.copied) == (1, 128, 145)
    b.add(lender)
    b.add(borrower)
    b.add(chained)
    for attempt in range(2):
        call = b.next_call()
        copies = call.plan.inputs.copies
        assert {id(u) for u in units_of(call)} == {id(lender), id(borrower), id(chained)}
        assert lent in call.written and entry in call.written and third in call.written
        np.testing.assert_array_equal(copies.from_pages[:12], lent.pages[1])
        np.testing.assert_array_equal(copies.to_pages[:12], entry.pages[1])
        np.testing.assert_array_equal(copies.from_offsets[:12], np.arange(12))
        np.testing.assert_array_equal(copies.to_offsets[:12], np.arange(12))
        # the chain: its first 12 slots from the lender's page, the next 5 from the borrower's
        np.testing.assert_array_equal(copies.from_pages[12:29], [lent.pages[1]] * 12 + [entry.pages[1]] * 5)
        np.testing.assert_array_equal(copies.from_offsets[12:29], np.arange(17))
        np.testing.assert_array_equal(copies.to_pages[12:29], third.pages[1])
        assert (copies.to_pages[29:] == POOL_PAGES).all()  # out of the pool: dropped
        pre = jax.tree.map(lambda a: a[0], call.plan.inputs.prefill)
        mine = pre.write_pages == entry.pages[1]
        np.testing.assert_array_equal(pre.positions[mine], np.arange(140, 190))  # its chunk, after the copy
        assert entry.ready and entry.written == 190
        if attempt == 0:  # the call failed: its work is queued again (engine/loop/recovery.py)
            cache.rewrite(lent)
            assert entry.written == 128 and not entry.ready and third.written == 128
            for u in (lender, borrower, chained):
                u.progress.taken = 0
                b.add(u)
    assert b.next_call() is None


def test_a_small_request_is_not_starved_behind_a_large_one():
    b, cache = setup()
    big = unit(cache, lengths=(20,) * 40)  # 800 tokens: several calls
    b.add(big)
    small = unit(cache, prefix=(4,) * 5, lengths=(3,))
    b.add(small)
    first = b.next_call()
    assert small in units_of(first) and big in units_of(first)


def test_earliest_deadline_first():
    b, cache = setup()
    late = unit(cache, lengths=(200,), deadline=1e12)
    early = unit(cache, prefix=(4,), lengths=(200,), deadline=1.0)
    b.add(late)
    b.add(early)
    assert units_of(b.next_call()) == [early]
    assert units_of(b.next_call()) == [late]


def test_cancelled_units_leave_the_queue():
    b, cache = setup()
    a, c = unit(cache, lengths=(3, 3)), unit(cache, lengths=(3,))
    b.add(a)
    b.add(c)
    b.cancel(a)
    assert b.depth == 1
    assert units_of(b.next_call()) == [c]
    assert b.depth == 0 and not b.ready()


def test_several_devices_split_segments_and_align_them():
    b, cache = setup(devices=2, align=64)
    us = [unit(cache, prefix=(k,) * 10, lengths=(20,) * 5) for k in range(3)]
    for u in us:
        b.add(u)
    call = b.next_call()
    items = call.plan.inputs.items
    assert (items.n_rows > 0).all() and items.n_rows.sum() == 15
    for dev in range(2):
        seg = items.segment_ids[dev]
        starts = np.flatnonzero(np.diff(seg, prepend=-1))
        assert all(s % 64 == 0 for s in starts), starts


def test_pool_pins_eviction_and_exhaustion():
    cache = PrefixCache(pages=4, page_tokens=128, page_bytes=10)
    evicted = []
    cache.on_evict = evicted.append
    a, hit = cache.acquire(tuple(range(300)))  # 3 pages
    assert not hit and len(a.pages) == 3 and cache.free_pages == 1
    with pytest.raises(PoolExhausted, match="needs 2 pages; 1 of 4"):
        cache.acquire(tuple(range(1000, 1200)))  # a is pinned: never evicted
    with pytest.raises(PoolExhausted, match="more than the pool's 4"):
        cache.acquire(tuple(range(2000, 2600)))
    a.written = 300
    cache.release(a)  # complete: stays cached, unpinned
    assert cache.pins(a.tokens) == 0 and a.tokens in cache
    again, hit = cache.acquire(a.tokens)
    assert hit and again is a
    cache.release(a)
    b_, _ = cache.acquire(tuple(range(1000, 1200)))  # evicts a (least recently used)
    assert a.tokens not in cache and evicted == [30] and cache.bytes == 20
    cache.release(b_)  # never written: dropped at once
    assert cache.free_pages == 4 and len(cache) == 0


def test_lent_pages_stay_until_their_borrowers_go():
    """A query borrows a cached query's leading whole pages (the same tokens): it takes only
    the rest and its prefill starts after them. The lender leaves the eviction order while
    borrowed; eviction frees a borrower first, then the lender it leaves idle, and counts both
    before it starts; a lender in use is never freed for a new query."""
    cache = PrefixCache(pages=6, page_tokens=4, page_bytes=1)
    lender, _ = cache.acquire(tuple(range(8)))  # 2 pages
    lender.written = 8
    borrower, hit = cache.acquire((*range(4), 100, 101, 102))  # its first page is the lender's
    assert not hit and borrower.pages[0] == lender.pages[0] and len(borrower.own_pages) == 1
    assert borrower.written == borrower.shared == 4 and cache.free_pages == 3
    borrower.written = 7
    cache.release(lender)
    assert lender.tokens not in cache._idle and cache._idle_pages == 0  # borrowed: not evictable
    cache.release(borrower)
    assert list(cache._idle) == [borrower.tokens] and cache._idle_pages == 1
    with pytest.raises(PoolExhausted, match="needs 7 pages, more than the pool.s 6"):
        cache.acquire(tuple(range(200, 228)))  # nothing is evicted for a query that cannot fit
    assert len(cache) == 2 and cache.evictions == 0
    taken, _ = cache.acquire(tuple(range(200, 220)))  # 5 pages: the borrower, then the lender
    assert cache.evictions == 2 and len(cache) == 1 and cache.free_pages == 1
    cache.release(taken)  # never written: dropped

    lender, _ = cache.acquire(tuple(range(8)))
    lender.written = 8
    borrower, _ = cache.acquire((*range(4), 7))
    borrower.written = 5
    with pytest.raises(PoolExhausted, match="needs 5 pages; 3 of 6"):
        cache.acquire(tuple(range(300, 320)))  # both pinned
    epoch = borrower.epoch
    cache.rewrite(lender)  # a call writing the lender failed: what the borrower computed over it is untrusted
    assert borrower.epoch == epoch + 1 and not borrower.ready and borrower.written == 4
    borrower.written = 5
    cache.rewrite(borrower)  # its own pages only: a borrower never writes a lender's page
    assert borrower.written == 4 and lender.written == 0
    cache.release(lender)
    cache.release(borrower)  # incomplete: dropped, and then its incomplete lender
    assert len(cache) == 0 and cache.free_pages == 6


def test_pool_book_stays_consistent_under_random_traffic():
    """The cache's counters (pinned prefixes, evictable pages, free pages) against a recount
    from its entries after every step of random acquires, releases, prefills and failed calls;
    prefixes of one repeated token share their leading pages (a page is one prefix's own, a
    borrower reads its cached lender's, and copies the first tokens of the next page)."""
    rng = np.random.default_rng(3)
    cache = PrefixCache(pages=12, page_tokens=4, page_bytes=1)
    held: list = []  # one element per pin
    shared = copied = chained = 0  # steps that saw a borrower, one that copied, one whose lender borrows
    for _ in range(3000):
        op = rng.integers(0, 4)
        if op == 0 or not held:
            tokens = (int(rng.integers(0, 12)),) * int(rng.integers(1, 13))
            try:
                entry, _ = cache.acquire(tokens)
            except PoolExhausted:
                continue
            held.append(entry)
        elif op == 1:
            entry = held.pop(int(rng.integers(0, len(held))))
            cache.release(entry)
        elif op == 2:
            held[int(rng.integers(0, len(held)))].written = 10**6  # its prefill was launched
        else:
            cache.rewrite(held[int(rng.integers(0, len(held)))])  # a call writing it failed
        entries = list(cache._entries.values())
        assert cache.pinned == sum(e.pins > 0 for e in entries)
        idle = [e for e in entries if e.pins == 0 and not e.borrowers]
        assert cache._idle_pages == sum(len(e.own_pages) for e in idle) and set(cache._idle.values()) == set(idle)
        # idle: its own tokens written (a lender rewritten since is prefilled again for a borrower
        # when the borrower is next needed: engine/loop/batcher.py)
        assert all(e.written >= len(e.tokens) for e in idle)
        in_use = {id(e) for e in entries if e.pins > 0}  # and, up each chain, what they borrow from
        for e in entries:
            lender = e.lender if e.pins > 0 else None
            while lender is not None:
                in_use.add(id(lender))
                lender = lender.lender
        assert cache._used_pages == sum(len(e.own_pages) for e in entries if id(e) in in_use)
        own = [p for e in entries for p in e.own_pages]
        in_use = {p for e in entries for p in e.pages}
        assert len(own) == len(set(own)) and set(own) == in_use  # a page is one entry's own
        assert len(in_use) + cache.free_pages == cache.total_pages and not in_use & set(cache._free)
        for e in entries:  # a borrower reads its lender's leading pages, which stays cached
            if e.lender is not None:
                shared += 1
                copied += e.copied > e.shared
                chained += e.lender.lender is not None
                assert e.lender in entries and e.lender.borrowers[id(e)] is e
                assert e.pages[: e.lent] == e.lender.pages[: e.lent] and e.shared == 4 * e.lent
                assert e.shared <= e.copied < len(e.tokens) and e.tokens[: e.copied] == e.lender.tokens[: e.copied]
    # prefixes of one repeated token share their leading tokens: whole pages, a page's first
    # tokens copied, from a lender that borrows in turn
    assert shared > 1000 and copied > 500 and chained > 50, (shared, copied, chained)


def w4_queue() -> tuple[Batcher, list[WorkUnit]]:
    """64 queued W4 requests: each its own new 300-token query, 10 items of 20 tokens."""
    buckets = Buckets.for_context(8192)
    cache = PrefixCache(1024, buckets.page_tokens, page_bytes=1)
    b = Batcher(lambda: CallBuilder(buckets, 1, 1, 1024, None), buckets.prefill_chunk)
    units = [unit(cache, prefix=(k,) * 300, lengths=(20,) * 10) for k in range(64)]
    for u in units:
        b.add(u)
    return b, units


def test_a_call_padded_past_its_bucket_takes_fewer_requests():
    """64 new 300-token queries with 10 items of 20 tokens (W4): filled greedily a call takes 13
    (3,900 prefill tokens in 4,096, 2,600 item tokens in 3,072: 9% padding); 10 fill 3,072 and
    2,048 almost exactly, so the call takes 10 and the rest wait for the next."""
    b, units = w4_queue()
    call = b.next_call()
    plan = call.plan
    assert units_of(call) == units[:10] and plan.chunks == 10
    assert 1 - (plan.prefill_tokens + plan.item_tokens) / plan.device_tokens < 0.05
    assert b.depth == 540


class _EveryTrimFilled(Batcher):
    """The batcher as it was before trims were decided from the first fill: every trim tried
    is filled (its first fill keeps no bounds)."""

    def _fill(self, pending, limit, item_tokens=None):
        fill = super()._fill(pending, limit, item_tokens)
        fill.bounds.clear()
        return fill


def _plans(batcher: Batcher) -> list[tuple]:
    """Every call the queue becomes: its shape and, per span, (unit, first item, count, row)."""
    out = []
    while (call := batcher.next_call()) is not None:
        out.append((call.plan.shape, [(s.ref.progress.seq, s.first, s.count, s.row) for s in call.plan.spans]))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_trims_decided_from_the_first_fill_plan_what_filling_every_trim_plans(seed):
    """Random queues of new and shared queries with items of mixed lengths (calls often land past
    a bucket, so trims are weighed): the calls planned are the same, call for call."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(int(rng.integers(20, 70))):
        hot = rng.random() < 0.3  # one of 12 hot queries (each always the same length), or a new one
        query = int(rng.integers(0, 12)) if hot else int(rng.integers(100, 10**6))
        length = 50 + 97 * query if hot else int(rng.integers(50, 1200))
        lengths = rng.integers(5, 120, int(rng.integers(1, 40))).tolist()
        requests.append(((query,) * length, lengths))
    buckets = Buckets.for_context(8192)
    queues = []
    for cls in (Batcher, _EveryTrimFilled):
        cache = PrefixCache(4096, buckets.page_tokens, page_bytes=1)
        b = cls(lambda: CallBuilder(buckets, 1, 1, 4096, None), buckets.prefill_chunk)
        for prefix, lengths in requests:
            b.add(unit(cache, prefix=prefix, lengths=lengths))
        queues.append(b)
    assert _plans(queues[0]) == _plans(queues[1])


def test_a_w4_call_is_filled_twice_not_once_per_trim(monkeypatch):
    """W4's trims (12 and 11 requests cannot fill better than 13; 10 can) cost one more fill, not four."""
    b, units = w4_queue()
    fills = []
    original = Batcher._fill

    def counted(self, pending, limit, item_tokens=None):
        fills.append(limit)
        return original(self, pending, limit, item_tokens)

    monkeypatch.setattr(Batcher, "_fill", counted)
    call = b.next_call()
    assert units_of(call) == units[:10] and fills == [None, 10]


def test_token_rows_hold_a_requests_items_in_one_array():
    rows = TokenRows.from_lists([[5, 6, 7], [8], [9, 10]])
    assert len(rows) == 3 and rows.total == 6 and rows.lengths.tolist() == [3, 1, 2]
    assert rows[1] == [8] and rows[-1] == [9, 10] and rows[:2] == [[5, 6, 7], [8]] and list(rows) == rows.tolist()
    assert rows.positions().tolist() == [0, 1, 2, 0, 0, 1]
    assert rows.with_suffix([1, 2]).tolist() == [[5, 6, 7, 1, 2], [8, 1, 2], [9, 10, 1, 2]]
    assert rows.map_rows(lambda r: r[:1]) == [[5], [8], [9]]
    assert TokenRows.from_lists([]).total == 0 and len(TokenRows.coerce([])) == 0


def test_an_earlier_segment_growing_is_appended_not_laid_out_again():
    """Two requests over one query, a third request between them in priority order: the
    second offer of the query opens a run of its own after the other request (its own
    page-table row, the same pages), and every row reads the right tokens and positions."""
    b, cache = setup()
    first = unit(cache, prefix=(1,) * 30, lengths=(4, 5))
    other = unit(cache, prefix=(2,) * 20, lengths=(3,))
    again = unit(cache, prefix=(1,) * 30, lengths=(6,))
    assert again.pin.entry is first.pin.entry
    for u in (first, other, again):
        b.add(u)
    call = b.next_call()
    plan, items = call.plan, call.plan.inputs.items
    assert [(s.ref, s.first, s.count) for s in plan.spans] == [(first, 0, 2), (other, 0, 1), (again, 0, 1)]
    seg = items.segment_ids[0]
    runs = [int(seg[s]) for s in np.flatnonzero(np.diff(seg[:18], prepend=-1))]
    assert len(runs) == 3 and len(set(runs)) == 3  # three runs, three page-table rows
    table, prefix_len = plan.inputs.page_table, plan.inputs.prefix_len
    assert table[runs[0]].tolist() == table[runs[2]].tolist() and prefix_len[runs[0]] == prefix_len[runs[2]] == 30
    assert items.positions[0, :9].tolist() == [30, 31, 32, 33, 30, 31, 32, 33, 34]
    assert items.positions[0, 12:18].tolist() == list(range(30, 36))
    tp = plan.inputs.prefill.tokens.shape[1]
    assert items.read_at[0, :4].tolist() == [tp + 3, tp + 8, tp + 11, tp + 17]
    assert items.item_ids[0, :18].tolist() == [0] * 4 + [1] * 5 + [2] * 3 + [3] * 6


def test_prefill_chunks_are_divided_between_data_replicas():
    """With two replicas a call's chunks go to the least filled one: each replica's stream holds
    half of them, and together they write every query token once (every replica's pool gets all
    of them: the device call gathers the replicas' K/V before each layer's write)."""
    b, cache = setup(devices=2, align=64)
    u = unit(cache, prefix=range(500), lengths=(3, 5))
    b.add(u)
    pre = b.next_call().plan.inputs.prefill
    real = pre.write_pages < POOL_PAGES
    assert pre.tokens.shape[0] == 2 and real[0].any() and real[1].any()
    assert real.sum() == 500 and sorted(pre.positions[real].tolist()) == list(range(500))
    assert abs(int(real[0].sum()) - int(real[1].sum())) <= 128  # balanced to a chunk


def test_a_small_request_is_not_split_by_its_fair_share():
    """64 W4-sized requests: a share of the call's item tokens is smaller than one request, but a
    request needing at most twice its share goes whole (one run each, never a second one)."""
    b, _ = w4_queue()
    while (call := b.next_call()) is not None:
        assert all(s.first == 0 and s.count == 10 for s in call.plan.spans)


def test_spans_cover_every_item_once_across_devices():
    b, cache = setup(devices=2, align=64)
    us = [unit(cache, prefix=(k,) * 10, lengths=(7, 30, 1, 12) * 3) for k in range(3)]
    for u in us:
        b.add(u)
    seen = {id(u): [] for u in us}
    while (call := b.next_call()) is not None:
        items = call.plan.inputs.items
        for span in call.plan.spans:
            seen[id(span.ref)] += range(span.first, span.first + span.count)
            dev, row = divmod(span.row, call.plan.shape.rows)
            for k in range(span.count):  # each row's last token is its item's last token
                n = len(span.ref.payload.items[span.first + k])
                at = items.read_at[dev, row + k] - call.plan.inputs.prefill.tokens.shape[1]
                assert items.item_ids[dev, at] == row + k and items.positions[dev, at] == 10 + n - 1
    assert all(sorted(v) == list(range(12)) for v in seen.values())


def test_results_split_per_span_and_a_nan_fails_only_its_request():
    b, cache = setup()
    good, bad = unit(cache, lengths=(3, 4)), unit(cache, prefix=(5,) * 9, lengths=(2,))
    b.add(good)
    b.add(bad)
    call = b.next_call()
    out = np.zeros((call.plan.shape.rows, call.plan.shape.labels), np.float32)
    out[:3, :2] = [[0.1, 0.2], [0.3, 0.4], [np.nan, 0.5]]
    complete, broken = take_results(call, out)
    assert complete == [good] and broken == [bad]
    np.testing.assert_array_equal(good.reply.answer, np.float32([[0.1, 0.2], [0.3, 0.4]]))


# ---- isolation: what a failed call's work becomes (engine/loop/isolation.py) ----------------------------
def _failed_call(batcher, units, group=None):
    """The call the batcher plans for `units` (their queries prefilled), as if it failed."""
    for u in units:
        u.pin.entry.written = len(u.pin.entry.tokens)
        batcher.add(u)
    call = batcher.next_call()
    call.group = group
    return call


def test_a_failed_call_over_many_queries_is_retried_in_halves_by_query():
    from prefixscore.engine.loop import isolation

    batcher, cache = setup()
    units = [unit(cache, prefix=(1, 2, k)) for k in range(6)]
    call = _failed_call(batcher, units)
    verdict = isolation.judge(call, isolation.pieces_of(call), [])
    assert verdict.culprits == []
    assert [[p.root for p in r.pieces] for r in verdict.retries] == [units[:3], units[3:]]
    small = _failed_call(batcher, [unit(cache, prefix=(3, k)) for k in range(3)])
    assert len(isolation.judge(small, isolation.pieces_of(small), []).retries) == 3  # one by one


def test_a_failed_call_of_one_query_alone_halves_its_items_down_to_the_culprit():
    from prefixscore.engine.loop import isolation

    batcher, cache = setup()
    alone = unit(cache, lengths=(2, 2, 2, 2, 2))
    call = _failed_call(batcher, [alone], group=0)
    verdict = isolation.judge(call, isolation.pieces_of(call), [])
    assert verdict.culprits == [] and [[(p.first, p.count) for p in r.pieces] for r in verdict.retries] == [
        [(0, 2)],
        [(2, 3)],
    ]
    waiting = unit(cache, lengths=(4,))  # the same query, queued
    one = isolation.judge(call, [isolation.Piece(alone, 3, 1)], [waiting])
    assert one.culprits == [alone] and [r.queued for r in one.retries] == [[waiting]]
    prefill = isolation.judge(call, [], [waiting])  # only the query's prefill rode: it is at fault
    assert prefill.culprits == [waiting] and prefill.retries == []


@pytest.mark.parametrize(
    ("lengths", "buckets_run"),
    [
        # 4,700 item tokens: 4,096 filled and the rest in 1,024 (5,120 device tokens), not 6,144
        ((147,) * 32 + (4,), [4096, 1024]),
        # 5,200: split it would run 4,096 + 2,048, no fewer than one 6,144 call: one call
        ((160,) * 32 + (80,), [6144]),
        # 1,000: it fills its bucket (1,024)
        ((100,) * 10, [1024]),
    ],
)
def test_a_request_past_a_bucket_fills_the_smaller_one_and_the_rest_runs_next(lengths, buckets_run):
    """One request alone (W8's shape: 32 passages): when its items land well past a bucket, the
    call fills the next smaller bucket (the request split where it stops) and the rest runs in the
    next call, if the two run fewer device tokens; every item is planned once, in order."""
    buckets = Buckets.for_context(8192)
    cache = PrefixCache(1024, buckets.page_tokens, page_bytes=1)
    b = Batcher(lambda: CallBuilder(buckets, 1, 1, 1024, None), buckets.prefill_chunk)
    b.add(unit(cache, prefix=(), lengths=lengths, item_first=True))
    calls = _plans(b)
    assert [shape.item_tokens for shape, _ in calls] == buckets_run
    firsts = [(first, count) for _, spans in calls for _, first, count, _ in spans]
    assert [f for f, _ in firsts] == np.cumsum([0] + [c for _, c in firsts[:-1]]).tolist()
    assert sum(c for _, c in firsts) == len(lengths)
