"""Every attention fast path against the jax.numpy oracle (kernels/reference.py).

The Pallas kernels run in interpret mode on CPU: TPU kernels in the TPU
interpreter (`pltpu.force_tpu_interpret_mode`), GPU (Triton) kernels in Pallas'
generic interpreter. Real-hardware runs: tests/test_kernels_device.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernel_calls import with_meta
from jax.experimental.pallas import tpu as pltpu

from prefixscore.kernels import dispatch, reference, selfcheck
from prefixscore.kernels.paged import NO_WINDOW, AttentionLogits, PagedAttentionMeta

IMPLS = ["xla", "pallas_tpu", "pallas_gpu"]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# One jax.jit per function for the whole module, so cases of equal shapes reuse one trace and one
# executable: an interpreted TPU kernel's program carries its callbacks, so a fresh trace of it is
# a fresh compilation (it never hits the persistent cache). The oracle's answers depend only on a
# case's inputs, not on the implementation under test: computed once per case, shared by the three.
_jit = functools.cache(lambda fn: jax.jit(fn, static_argnames=("logits",)))


@contextlib.contextmanager
def interpreted(name: str):
    if name == "pallas_tpu" and jax.default_backend() != "tpu":
        with pltpu.force_tpu_interpret_mode():
            yield
    else:
        yield


def rand(rng: np.random.Generator, *shape: int, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape), dtype)


def segments(lengths: list[int], n: int) -> jax.Array:
    """Items back to back, then padding, one negative id a token (what the engine packs: no item
    is longer than the call's max_item_len)."""
    seg = -1 - np.arange(n, dtype=np.int32)
    at = 0
    for i, length in enumerate(lengths):
        seg[at : at + length] = i
        at += length
    return jnp.asarray(seg)


def close(a: jax.Array, b: jax.Array, dtype) -> None:
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=TOL[dtype], rtol=TOL[dtype])


def brute_force(x: dict) -> np.ndarray:
    """The stream's attention token by token in float64 numpy, straight from the definition
    (kernels/paged.py): token t at position p sees its segment's first prefix_len pooled keys
    and the earlier tokens of its own item (within its region), of those only the ones at
    positions in (p - window, p]; logits: scores times the scale, then soft-capped. Checks
    the oracle itself."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    q, k, v, pk, pv, meta = f64(x["q"]), f64(x["k"]), f64(x["v"]), f64(x["pool_k"]), f64(x["pool_v"]), x["meta"]
    seg, item, pos = np.asarray(meta.segment_ids), np.asarray(meta.item_ids), np.asarray(meta.positions)
    table, plen, layer = np.asarray(meta.page_table), np.asarray(meta.prefix_len), int(meta.layer)
    window, logits = int(meta.window), meta.logits
    n, heads, d = q.shape
    kv = k.shape[1]
    scale = d**-0.5 if logits.scale is None else logits.scale
    region = np.arange(n) >= meta.split
    out = np.zeros_like(q)
    for t in range(n):
        pages = table[seg[t]]
        seen = np.arange(plen[seg[t]])  # prefix key c sits at position c
        seen = seen[seen > pos[t] - window]
        keys = pk[layer][:, pages].reshape(kv, -1, d)[:, seen]
        vals = pv[layer][:, pages].reshape(kv, -1, d)[:, seen]
        own = (item == item[t]) & (region == region[t]) & (np.arange(n) <= t) & (pos > pos[t] - window)
        own = np.nonzero(own)[0]
        for h in range(heads):
            g = h // (heads // kv)
            kk = np.concatenate([keys[g], k[own, g]])
            vv = np.concatenate([vals[g], v[own, g]])
            s = kk @ q[t, h] * scale
            if logits.softcap is not None:
                s = logits.softcap * np.tanh(s / logits.softcap)
            p = np.exp(s - s.max())
            out[t, h] = p @ vv / p.sum()
    return out


@pytest.mark.parametrize("windowed", [False, True])
def test_reference_is_the_definition(windowed: bool) -> None:
    """A plain layer, and a windowed one (shorter than the prefixes, the prefill chunk and the
    long items) with a soft cap and a scale of its own, over the same pool."""
    window = dict(window=selfcheck.WINDOW, logits=selfcheck.LOGITS) if windowed else {}
    x = selfcheck.case(4, 2, 16, jnp.float32, seed=3, **window)
    got = reference.paged_attention(x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"], x["meta"])
    read = selfcheck.read_rows(x["meta"])  # padding's positions (0) are not its item's
    np.testing.assert_allclose(np.asarray(got)[read], brute_force(x)[read], atol=2e-5, rtol=2e-5)


@functools.cache
def paged_case(dtype: str, windowed: bool) -> tuple[dict, jax.Array, tuple[jax.Array, jax.Array]]:
    """test_paged_attention's input, and the oracle's paged_attention (in float32 from the same
    rounded inputs) and paged_prefix_attention (in the input dtype) of it."""
    window = dict(window=selfcheck.WINDOW, logits=selfcheck.LOGITS) if windowed else {}
    x = selfcheck.case(8, 2, 64, dtype, seed=1, **window)
    if not windowed:  # what a model without sliding layers traces (kernels/paged.py never_windowed)
        x["meta"] = dataclasses.replace(x["meta"], window=NO_WINDOW)
    f32 = {**x, **{n: x[n].astype(jnp.float32) for n in ("q", "k", "v", "pool_k", "pool_v")}}
    want = reference.paged_attention(f32["q"], f32["k"], f32["v"], f32["pool_k"], f32["pool_v"], x["meta"])
    return x, want, reference.paged_prefix_attention(x["q"], x["pool_k"], x["pool_v"], x["meta"])


@pytest.mark.parametrize("impl", IMPLS)
# windowed: a sliding window shorter than the prefixes, the chunk and the long items, a soft
# cap and a scale of its own (bfloat16 without a window: tests/test_kernels_selfcheck.py)
@pytest.mark.parametrize(("dtype", "windowed"), [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, True)])
def test_paged_attention(impl: str, dtype, windowed: bool) -> None:
    """A call's whole stream: a prefill chunk over its query's earlier pages, items of three
    queries over out-of-order pages, whole sequences over no prefix, padding; grouped-query."""
    x, want, (want_p, want_lse) = paged_case(jnp.dtype(dtype).name, windowed)
    with interpreted(impl):
        m = dispatch.get(impl)
        got = with_meta(m.paged_attention, x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"], meta=x["meta"])
        out_p, lse_p = with_meta(m.paged_prefix_attention, x["q"], x["pool_k"], x["pool_v"], meta=x["meta"])
    assert got.dtype == dtype
    read = selfcheck.read_rows(x["meta"])
    close(got[read], want[read], dtype)
    if dtype == jnp.float32:
        assert lse_p.dtype == jnp.float32 and lse_p.shape == want_lse.shape
        sees = np.asarray(want_lse[:, 0]) > reference.MASK_VALUE / 2  # a prefix key, not all before its window
        assert sees.sum() > 300 and (read & ~sees).sum() > (100 if windowed else 0)
        close(out_p[read & sees], want_p[read & sees], dtype)
        close(lse_p[read & sees], want_lse[read & sees], dtype)
        # no prefix key seen: a part the merge must weigh 0
        assert (np.asarray(lse_p)[read & ~sees] <= reference.MASK_VALUE / 2).all()


@pytest.mark.parametrize(("dtype", "windowed"), [(jnp.float32, False), (jnp.bfloat16, True)])
def test_xla_whole_sequences_skip_the_prefix_part_with_the_same_bits(dtype, windowed: bool) -> None:
    """A CPU call of whole sequences (no prefill region, no segment with a prefix) takes the causal
    part alone: the same bits as that part merged with a prefix part that sees no key."""
    from prefixscore.kernels import xla

    x, _, _ = paged_case(jnp.dtype(dtype).name, windowed)
    meta = dataclasses.replace(x["meta"], split=0, prefix_len=jnp.zeros_like(x["meta"].prefix_len))
    q, k, v, pk, pv = x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"]
    got = with_meta(xla.paged_attention, q, k, v, pk, pv, meta=meta)

    def merged(q, k, v, pk, pv, meta):
        out_p, lse_p = xla.paged_prefix_attention(q, pk, pv, meta)
        out_i, lse_i = xla.ragged_item_attention(q, k, v, meta.item_ids, meta.max_item_len, meta.window, meta.logits)
        return xla.merge_attention(out_p, lse_p, out_i, lse_i)

    read = selfcheck.read_rows(meta)
    np.testing.assert_array_equal(
        np.asarray(got, np.float32)[read], np.asarray(with_meta(merged, q, k, v, pk, pv, meta=meta), np.float32)[read]
    )


@functools.cache
def ragged_case(lengths: tuple[int, ...], window: int | None) -> tuple[tuple, tuple[jax.Array, jax.Array]]:
    """test_ragged_item_attention's input (q, k, v, segment ids, window and logits) and the oracle's answer."""
    rng = np.random.default_rng(len(lengths))
    n, heads, kv, d = 256, 4, 2, 64
    q, k, v = rand(rng, n, heads, d), rand(rng, n, kv, d), rand(rng, n, kv, d)
    seg = segments(list(lengths), n)
    extra = {} if window is None else dict(window=jnp.int32(window), logits=selfcheck.LOGITS)
    return (q, k, v, seg, extra), _jit(reference.ragged_item_attention)(q, k, v, seg, None, **extra)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("lengths", "window"),
    # the last two: a window (with a soft cap and a scale) that cuts the long items, not the short
    # ones; and one that cuts short items (all of them fit the two-block path, which sees no window)
    [
        ([5, 70, 1, 20, 130, 3], None),
        ([256], None),
        ([64] * 4, None),
        ([1] * 200, None),
        ([5, 70, 1, 130, 40], 40),
        ([5, 20, 1, 30, 12], 8),
    ],
)
def test_ragged_item_attention(impl: str, lengths: list[int], window: int | None) -> None:
    (q, k, v, seg, extra), (want_out, want_lse) = ragged_case(tuple(lengths), window)
    with interpreted(impl):
        out, lse = _jit(dispatch.get(impl).ragged_item_attention)(q, k, v, seg, jnp.int32(max(lengths)), **extra)
    close(out, want_out, jnp.float32)
    close(lse, want_lse, jnp.float32)


def test_xla_long_items_keep_their_bits_with_or_without_short_items_and_at_the_stream_s_end() -> None:
    """The CPU item part runs its short items' pass only in a call that holds a short item, and a
    long item's last block may overhang the stream into the room past it: a long item's rows are
    the same bits alone (no short pass), beside a short item (the pass runs), and ending the
    stream, as they are in the reference."""
    rng = np.random.default_rng(12)
    heads, kv, d, n = 4, 2, 64, 320
    lengths = (70, 130)
    q, k, v = rand(rng, sum(lengths), heads, d), rand(rng, sum(lengths), kv, d), rand(rng, sum(lengths), kv, d)
    attend = _jit(dispatch.get("xla").ragged_item_attention)

    def placed(at: int, short: int) -> tuple[np.ndarray, np.ndarray]:
        """The long items at `at`, a short item of `short` tokens after them (0: none), padding
        (an id of its own, negative, a token) elsewhere; the long items' out and lse."""
        seg = -1 - np.arange(n, dtype=np.int32)
        end = at
        for i, length in enumerate((*lengths, short)):
            seg[end : end + length] = i
            end += length
        rows = slice(at, at + sum(lengths))

        def stream(x: jax.Array) -> jax.Array:
            return jnp.zeros((n, *x.shape[1:]), x.dtype).at[rows].set(x)

        out, lse = attend(stream(q), stream(k), stream(v), jnp.asarray(seg), jnp.int32(max(lengths)))
        return np.asarray(out[rows]), np.asarray(lse[rows])

    alone = placed(3, 0)
    want_out, want_lse = _jit(reference.ragged_item_attention)(q, k, v, segments(list(lengths), sum(lengths)), None)
    close(alone[0], want_out, jnp.float32)
    close(alone[1], want_lse, jnp.float32)
    for at, short in ((3, 5), (n - sum(lengths), 0), (n - sum(lengths) - 5, 5)):
        got = placed(at, short)
        np.testing.assert_array_equal(got[0], alone[0])
        np.testing.assert_array_equal(got[1], alone[1])


def test_xla_prefix_steps_of_every_size() -> None:
    """The CPU path's step choices (kernels/xla.py), unaligned as it packs them: prefill chunks
    (whose whole attention it reads back from the pool) over no prefix and over earlier pages;
    item runs whose rest takes each query-tail size (and none), over prefixes whose rest takes no
    last step, half a tail step or a whole one, after zero or one whole key chunk. Then on
    windowed layers: a window shorter than a query block (rows that see no prefix key beside
    rows that see some) and one longer than a key chunk."""
    from prefixscore.kernels import xla

    rng = np.random.default_rng(11)
    heads, kv, d, page = 4, 2, 32, 128
    chunks = [(300, 0), (70, 200), (260, 1000)]  # (tokens, prefix length): the prefill region
    # the first: whole sequences over no prefix, the segment the prefill padding is in too
    runs = [(3, 0), (40, 300), (100, 128), (200, 1100), (256, 1), (300, 1280), (129, 129), (10, 257)]
    segs = chunks + runs
    split = sum(t for t, _ in chunks) + 5  # + prefill padding: its own token items, no prefix
    n = split + sum(t for t, _ in runs) + 23  # + item padding
    pages_per = -(-max(t + p for t, p in segs) // page)
    pool_pages = pages_per * len(segs)
    table = rng.permutation(pool_pages).reshape(len(segs), pages_per).astype(np.int32)
    seg = np.full(n, runs.index((3, 0)) + len(chunks), np.int32)  # padding: a no-prefix segment
    item = -1 - np.arange(n, dtype=np.int32)  # padding: an item per token
    positions = np.zeros(n, np.int32)
    at = 0
    for i, (t, p) in enumerate(segs):
        at = split if i == len(chunks) else at
        seg[at : at + t] = i
        item[at : at + t] = i if i < len(chunks) else at + np.arange(t)  # a chunk is one item
        positions[at : at + t] = p + np.arange(t)  # a run's rows at positions of their own: varied windows
        at += t
    meta = PagedAttentionMeta(
        segment_ids=jnp.asarray(seg),
        item_ids=jnp.asarray(item),
        page_table=jnp.asarray(table),
        prefix_len=jnp.asarray([p for _, p in segs], jnp.int32),
        max_chunk_len=jnp.int32(300),
        max_item_len=jnp.int32(1),
        layer=jnp.int32(1),
        positions=jnp.asarray(positions),
        window=jnp.int32(NO_WINDOW),
        split=split,
    )
    q, k, v = rand(rng, n, heads, d), rand(rng, n, kv, d), rand(rng, n, kv, d)
    pk, pv = rand(rng, 2, kv, pool_pages, page, d), rand(rng, 2, kv, pool_pages, page, d)
    at = 0
    for i, (t, p) in enumerate(chunks):  # the call writes each chunk's K/V before attention
        pos = p + np.arange(t)
        where = (1, slice(None), table[i][pos // page], pos % page)
        pk, pv = pk.at[where].set(k[at : at + t]), pv.at[where].set(v[at : at + t])
        at += t
    read = selfcheck.read_rows(meta)  # padding tokens' outputs are never read
    # the window is a traced value: one compilation of each for all three
    prefix, whole = jax.jit(xla.paged_prefix_attention), jax.jit(xla.paged_attention)
    want_prefix, want_whole = jax.jit(reference.paged_prefix_attention), jax.jit(reference.paged_attention)
    for window in (NO_WINDOW, 150, 1100):
        meta = dataclasses.replace(meta, window=jnp.int32(window))
        want_p, want_lse = want_prefix(q, pk, pv, meta)
        got_p, got_lse = prefix(q, pk, pv, meta)
        sees = read & (np.asarray(want_lse[:, 0]) > reference.MASK_VALUE / 2)  # some prefix key
        close(got_p[sees], want_p[sees], jnp.float32)
        close(got_lse[sees], want_lse[sees], jnp.float32)
        assert (np.asarray(got_lse)[read & ~sees] <= reference.MASK_VALUE / 2).all()  # weighed 0
        close(whole(q, k, v, pk, pv, meta)[read], want_whole(q, k, v, pk, pv, meta)[read], jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_attention(impl: str) -> None:
    rng = np.random.default_rng(5)
    oa, ob = rand(rng, 64, 4, 64), rand(rng, 64, 4, 64)
    la, lb = rand(rng, 64, 4) * 5, rand(rng, 64, 4) * 5
    lb = lb.at[0].set(reference.MASK_VALUE)  # a part that saw no key weighs nothing
    with interpreted(impl):
        got = dispatch.get(impl).merge_attention(oa, la, ob, lb)
    close(got, reference.merge_attention(oa, la, ob, lb), jnp.float32)


def test_attention_logits_are_static_and_checked() -> None:
    assert hash(selfcheck.LOGITS) == hash(AttentionLogits(scale=0.1, softcap=2.0))  # a static field: hashable
    for bad in (dict(scale=0.0), dict(softcap=-1.0)):
        with pytest.raises(ValueError, match="must be positive"):
            AttentionLogits(**bad)


def test_dispatch_names_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dispatch.resolve(backend="cpu") == "xla"
    assert dispatch.resolve(backend="tpu") == "pallas_tpu"
    assert dispatch.resolve(backend="gpu") == "pallas_gpu"
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "reference")
    assert dispatch.resolve(backend="tpu") == "reference"
    assert dispatch.resolve("pallas_gpu") == "pallas_gpu"  # explicit beats the environment
    with pytest.raises(ValueError, match="unknown"):
        dispatch.resolve("nope")
    for name in dispatch.IMPLEMENTATIONS:
        module = dispatch.get(name)
        assert module.SEGMENT_ALIGN >= 1 and selfcheck.ALIGN % module.SEGMENT_ALIGN == 0, name
        for fn in ("paged_prefix_attention", "ragged_item_attention", "merge_attention", "paged_attention"):
            assert callable(getattr(module, fn)), (name, fn)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_untileable_shapes_fall_back(impl: str) -> None:
    """Head dims a kernel cannot tile still give the right answer (the XLA path)."""
    x = selfcheck.case(4, 2, 16, jnp.float32, seed=9)
    want = reference.paged_attention(x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"], x["meta"])
    with interpreted(impl):
        got = dispatch.get(impl).paged_attention(x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"], x["meta"])
    read = selfcheck.read_rows(x["meta"])
    close(got[read], want[read], jnp.float32)


def test_xla_short_chunks_share_the_key_steps_they_read_alike_with_the_same_bits() -> None:
    """The CPU path's shared key steps (kernels/paged.py SharedSteps, grouped by the planner's
    engine/runtime/shared_steps.py): short prefill chunks whose first pages are the same (lm-eval's
    sibling choices over one k-shot header) take those key steps in one block, then each its own
    from there. Grouped: chunks on those pages within 64 tokens of a group's first; not: a chunk
    over other pages between them, a chunk longer than the block, one that ends past its group's
    block; a group whose second chunk's pages part sooner takes fewer steps. Every chunk's rows
    equal the oracle's, and the same bits as the chunk alone in its call."""
    from prefixscore.engine.runtime.shared_steps import ChunkPlace, StepSharing, shared_steps
    from prefixscore.kernels import xla
    from prefixscore.kernels.paged import SharedSteps

    rng = np.random.default_rng(7)
    heads, kv, d, page, n = 6, 2, 32, 16, 256
    header, own = 48, 72  # pages: a 768-key header every segment but one reads, then pages of its own
    # (segment, prefix length, tokens), back to back from token 0
    chunks = [(1, 998, 8), (2, 877, 10), (3, 952, 7), (7, 930, 5), (4, 994, 10), (5, 968, 2), (8, 880, 90)]
    chunks += [(6, 900, 8), (9, 300, 6), (10, 950, 60)]
    segments = 11
    table = np.stack([np.arange(header)] * segments)
    table[7] = header + np.arange(header)  # another header
    table = np.concatenate([table, 2 * header + own * np.arange(segments)[:, None] + np.arange(own)], axis=1)
    table[9, 16:] = table[9, header:].tolist() + [0] * (header - 16)  # its own pages from key 256 on
    pool_pages = 2 * header + own * segments
    q, k, v = rand(rng, n, heads, d), rand(rng, n, kv, d), rand(rng, n, kv, d)
    pk, pv = rand(rng, 1, kv, pool_pages, page, d), rand(rng, 1, kv, pool_pages, page, d)
    sharing = StepSharing(xla.SHARED_BLOCK, xla.key_step_pages(page, table.shape[1]))  # 256-key steps

    def call(layout: list[tuple[int, int, int]], rows_from: list[int]) -> tuple[PagedAttentionMeta, dict]:
        """A stream of these chunks (their q, k, v from rows_from), the pool with their K/V written,
        the groups as the planner forms them."""
        seg, item, pos = np.zeros(n, np.int32), -1 - np.arange(n, dtype=np.int32), np.zeros(n, np.int32)
        plen, take = np.zeros(segments, np.int32), np.arange(n)
        wk, wv, at, places = pk, pv, 0, []
        for i, ((s, length, tokens), src) in enumerate(zip(layout, rows_from, strict=True)):
            seg[at : at + tokens], item[at : at + tokens], plen[s] = s, i, length
            pos[at : at + tokens], take[at : at + tokens] = length + np.arange(tokens), src + np.arange(tokens)
            where = (0, slice(None), table[s][pos[at : at + tokens] // page], pos[at : at + tokens] % page)
            wk, wv = wk.at[where].set(k[take[at : at + tokens]]), wv.at[where].set(v[take[at : at + tokens]])
            places.append(ChunkPlace(at, tokens, length + tokens, table[s].tolist()))
            at += tokens
        blocks, count, block_of, steps = shared_steps(places, n, page, sharing)
        meta = PagedAttentionMeta(
            segment_ids=jnp.asarray(seg),
            item_ids=jnp.asarray(item),
            page_table=jnp.asarray(table, jnp.int32),
            prefix_len=jnp.asarray(plen),
            max_chunk_len=jnp.int32(90),
            max_item_len=jnp.int32(1),
            layer=jnp.int32(0),
            positions=jnp.asarray(pos),
            window=NO_WINDOW,
            shared=SharedSteps(*(jnp.asarray(a, jnp.int32) for a in (blocks, count, block_of, steps))),
            split=n,
        )
        return meta, dict(q=q[take], k=k[take], v=v[take], pool_k=wk, pool_v=wv)

    starts = np.cumsum([0] + [t for _, _, t in chunks])[:-1].tolist()
    meta, x = call(chunks, starts)
    # 768 keys read alike: 3 steps of 256; in the second group, segment 9's pages part from
    # segment 6's at key 256: one step
    assert np.asarray(meta.shared.steps)[starts].tolist() == [3, 3, 3, 0, 3, 3, 0, 1, 1, 0]
    assert int(meta.shared.count) == 2 and np.asarray(meta.shared.blocks)[:3].tolist() == [0, 132, -1]
    got = np.asarray(with_meta(xla.paged_attention, x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"], meta=meta))
    want = reference.paged_attention(x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"], meta)
    read = np.asarray(meta.item_ids) >= 0
    close(got[read], np.asarray(want)[read], jnp.float32)
    for (s, length, tokens), at in zip(chunks, starts, strict=True):
        alone_meta, alone = call([(s, length, tokens)], [at])
        assert int(alone_meta.shared.count) == 0
        arrays = (alone[name] for name in ("q", "k", "v", "pool_k", "pool_v"))
        by_itself = np.asarray(with_meta(xla.paged_attention, *arrays, meta=alone_meta))
        np.testing.assert_array_equal(got[at : at + tokens], by_itself[:tokens], err_msg=f"segment {s}")


def test_the_planner_groups_short_chunks_from_where_a_group_starts_not_by_fixed_windows() -> None:
    """engine/runtime/shared_steps.py: a group's block starts at its first chunk, so chunks on
    either side of a multiple of the block join it; a chunk on other pages within the block joins
    none and leaves the group open; a chunk that ends past the block starts the next group."""
    from prefixscore.engine.runtime.shared_steps import ChunkPlace, StepSharing, shared_steps

    header = list(range(8))  # 8 pages of 16 keys: two 4-page steps
    other = list(range(100, 108))
    chunks = [
        ChunkPlace(60, 4, 130 + 4, [*header, 20, 21]),
        ChunkPlace(64, 5, 131 + 5, [*header, 30, 31]),
        ChunkPlace(69, 3, 130 + 3, [*other, 40, 41]),  # other pages: in no group
        ChunkPlace(72, 6, 70 + 6, [*header[:4], 50, 51]),  # parts after one step: the group takes one
        ChunkPlace(120, 8, 140 + 8, [*header, 60, 61]),  # past 60 + 64: the next group, alone
    ]
    blocks, count, block_of, steps = shared_steps(chunks, 256, 16, StepSharing(64, 4))
    assert count == 1 and blocks[:2].tolist() == [60, -1]
    assert [int(block_of[c.at]) for c in chunks] == [60, 60, -1, 60, -1]
    assert [int(steps[c.at]) for c in chunks] == [1, 1, 0, 1, 0]
    assert (block_of[60:78] >= 0).sum() == 4 + 5 + 6
