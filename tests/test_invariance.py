"""The same input, the same answer, bit for bit (docs/design.md, "The same answer whatever the
call"): a needle request alone, then the same request among other items of other lengths, at
several places among them, beside other queries, with its query cold, cached, prefilled in chunks
or borrowed from another query's pages. Every kind (score, likelihood, classify, embeddings), in
float32, bfloat16, W8A16 and W8A8; the raw float32 rows the device returned compared with
`assert_array_equal`, and the answers built from them with `==`.

Nothing here names a bucket or a layout: each comparison is a request alone against the same
request in company, so a layout that changes how calls are filled must keep them equal."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import SMALL_BUCKETS, make_torch_model

from prefixscore import Scorer
from prefixscore.engine.requests.classify import ClassifyInput
from prefixscore.engine.requests.embedding import EmbedInput
from prefixscore.engine.requests.kind import Done, plain, served, to_run
from prefixscore.engine.requests.score import ScoreInput

# W8A16 and W8A8 are the int8 projections with and without 8-bit activations
NUMERICS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "w8a16": dict(dtype="float32", quantize="int8", activations="none"),
    "w8a8": dict(dtype="float32", quantize="int8", activations="dynamic"),
}
# a query longer than a prefill chunk (128 tokens in SMALL_BUCKETS): prefilled in chunks
QUERY_TOKENS = 300
VOCAB = 49152


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(100, VOCAB - 100, n)]


@functools.cache
def lm(numerics: str) -> Scorer:
    return Scorer.load("tiny-qwen3", buckets=SMALL_BUCKETS, **NUMERICS[numerics])


def run_together(scorer: Scorer, requests: list[tuple[str, object]]) -> list[tuple[list[np.ndarray], object]]:
    """Requests (kind, input) queued together, so their prefills and items share calls; per request
    the raw rows of each of its engine requests and its answer as plain values."""
    kinds = [scorer.kinds[kind] for kind, _ in requests]
    plans = [kind.plan(inp) for kind, (_, inp) in zip(kinds, requests, strict=True)]
    todo = [to_run(plan) for plan in plans]
    units = iter(scorer.runner.run_requests([r for rs in todo for r in rs]))
    out = []
    for kind, plan, rs in zip(kinds, plans, todo, strict=True):
        done = [Done.of(next(units)) for _ in rs]
        out.append(([d.answer for d in done], plain(served(kind, plan, done).result)))
    return out


Result = tuple[list[np.ndarray] | None, object]


def entry(result: Result, at: int) -> Result:
    """The needle's entry of a request that holds other items too (its answer's entry `at`)."""
    return None, result[1][at]  # type: ignore[index]


def assert_same(got: Result, want: Result, case: str) -> None:
    """Raw rows bit for bit (where both are a whole request's), answers value for value (plain
    floats converted exactly from float32: == is bit equality)."""
    if got[0] is not None and want[0] is not None:
        assert len(got[0]) == len(want[0]), case
        for g, w in zip(got[0], want[0], strict=True):
            np.testing.assert_array_equal(g, w, err_msg=case)
    assert got[1] == want[1], case


class Haystack:
    """A needle request of one kind against the same request in company."""

    def __init__(self, scorer: Scorer, seed: int = 0) -> None:
        self.scorer = scorer
        self.rng = np.random.default_rng(seed)

    def alone_cold(self, kind: str, inp: object) -> tuple[list[np.ndarray], object]:
        self.scorer.engine.prefix_cache.evict_idle()
        return run_together(self.scorer, [(kind, inp)])[0]

    def beside(self, needle: tuple[str, object], others: list[tuple[str, object]], at: int):
        """The needle at index `at` among `others` (all queued together); its result."""
        requests = others[:at] + [needle] + others[at:]
        return run_together(self.scorer, requests)[at]


def score_input(query: list[int], items: list[list[int]], labels: list[int], **options) -> ScoreInput:
    return ScoreInput(query=query, items=items, label_token_ids=labels, **options)


def check_score(scorer: Scorer, needle_tokens: int) -> None:
    """A 300-token query with one item and 64 labels, full-vocabulary probabilities: alone cold,
    alone warm, among 255 other items of 3-60 tokens at the start, middle and end, beside 15 other
    queries (cold and warm), after a query that shares its first 160 tokens (a page borrowed, the
    rest copied), beside that query, after a query that shares 200 tokens and has 140 of them from
    a third (a chain of lenders), and with its own query prefilled in chunks beside other prefills."""
    hay = Haystack(scorer)
    rng = hay.rng
    query, needle, labels = ids(rng, QUERY_TOKENS), ids(rng, needle_tokens), ids(rng, 64)

    def needle_with(items_before: list[list[int]], items_after: list[list[int]], q: list[int] = query):
        return ("score", score_input(q, [*items_before, needle, *items_after], labels))

    alone = hay.alone_cold(*needle_with([], []))
    cases = {"alone warm": run_together(hay.scorer, [needle_with([], [])])[0]}
    others = [ids(rng, int(n)) for n in rng.integers(3, 61, 255)]
    # the needle three times among them (one haystack, three places): first, in the middle, last
    haystack = [needle, *others[:128], needle, *others[128:], needle]
    result = run_together(hay.scorer, [("score", score_input(query, haystack, labels))])[0]
    for at in (0, 129, 257):
        cases[f"among 255 items at {at}"] = entry(result, at)
    queries = [("score", score_input(ids(rng, int(rng.integers(40, 400))), others[:8], labels)) for _ in range(15)]
    cases["beside 15 queries, all warm"] = hay.beside(needle_with([], []), queries, 7)
    hay.scorer.engine.prefix_cache.evict_idle()
    fresh = [("score", score_input(ids(rng, int(rng.integers(40, 400))), others[:4], labels)) for _ in range(15)]
    cases["cold, beside 15 cold queries (chunked prefills)"] = hay.beside(needle_with([], []), fresh, 15)
    hay.scorer.engine.prefix_cache.evict_idle()
    lender = query[:160] + ids(rng, 100)
    run_together(hay.scorer, [("score", score_input(lender, others[:2], labels))])
    cases["its first 160 query tokens borrowed (a page) and copied"] = run_together(hay.scorer, [needle_with([], [])])[
        0
    ]
    hay.scorer.engine.prefix_cache.evict_idle()
    lender = query[:160] + ids(rng, 100)
    both = [("score", score_input(lender, others[:2], labels)), needle_with([], [])]
    cases["its first 160 tokens from a query queued beside it"] = run_together(hay.scorer, both)[1]
    hay.scorer.engine.prefix_cache.evict_idle()
    first, second = query[:140] + ids(rng, 60), query[:200] + ids(rng, 30)
    run_together(hay.scorer, [("score", score_input(q, others[:2], labels)) for q in (first, second)])
    cases["its first 200 tokens from a query that has its first 140 from a third"] = run_together(
        hay.scorer, [needle_with([], [])]
    )[0]
    for case, got in cases.items():
        assert_same(got, alone if got[0] is not None else entry(alone, 0), case)


@pytest.mark.parametrize("numerics", list(NUMERICS))
@pytest.mark.parametrize("needle_tokens", [20, 45])  # a short item and a long one (past 33 tokens)
def test_a_score_is_the_same_whatever_rides_beside_it(numerics: str, needle_tokens: int) -> None:
    check_score(lm(numerics), needle_tokens)


@pytest.mark.parametrize("window", [None, 300])
def test_a_tokens_attention_is_the_same_however_its_query_is_chunked_and_its_item_placed(window) -> None:
    """The CPU attention (kernels/xla.py) at the kernel: a 1,500-token query's tokens prefilled in one
    chunk, in two, or from 1,100 on beside another query's chunk, give the same bits at the same
    positions (its steps of keys follow each token's position, not its chunk's start or its block's
    other rows); an item of 20 or 45 tokens gives the same bits at any offset among items of 3-60
    tokens, and after one item of 1-32 tokens (every offset of its block), as alone. With a sliding
    window (300 keys) as well."""
    import jax.numpy as jnp
    from helpers.kernel_calls import with_meta

    from prefixscore.kernels import xla
    from prefixscore.kernels.paged import NO_WINDOW, PagedAttentionMeta

    rng = np.random.default_rng(5)
    heads, kv, d, page, query = 4, 2, 32, 16, 1500
    pages = -(-query // page) + 8
    pool_k, pool_v = (jnp.asarray(rng.normal(size=(1, kv, 2 * pages, page, d)), jnp.float32) for _ in range(2))
    table = jnp.asarray([np.arange(pages), np.arange(pages), np.arange(pages, 2 * pages)], jnp.int32)
    q_all = rng.normal(size=(query, heads, d)).astype(np.float32)

    def stream(chunks: list[tuple[int, int, int]], items: list[int], needle_at: int | None, n: int):
        """chunks: (segment, start, end) of the query (segment 2: another query's pages); then items
        of these lengths over segment 0's whole prefix. Returns the call's output."""
        split = sum(end - start for _, start, end in chunks)
        seg, item = np.zeros(n, np.int32), -1 - np.arange(n, dtype=np.int32)
        pos = np.zeros(n, np.int32)
        q = rng.normal(size=(n, heads, d)).astype(np.float32)
        k, v = rng.normal(size=(n, kv, d)).astype(np.float32), rng.normal(size=(n, kv, d)).astype(np.float32)
        at = 0
        for i, (s, start, end) in enumerate(chunks):
            seg[at : at + end - start], item[at : at + end - start] = s, i
            pos[at : at + end - start] = np.arange(start, end)
            q[at : at + end - start] = q_all[start:end]
            at += end - start
        prefix_len = [0, 0, 0]
        for s, start, _ in chunks:
            prefix_len[s] = start
        prefix_len[0] = query if items else prefix_len[0]
        for i, length in enumerate(items):
            seg[at : at + length], item[at : at + length] = 0, 1000 + i
            pos[at : at + length] = query + np.arange(length)
            if i == needle_at:
                q[at : at + length], k[at : at + length], v[at : at + length] = needle
            at += length
        meta = PagedAttentionMeta(
            segment_ids=jnp.asarray(seg),
            item_ids=jnp.asarray(item),
            page_table=table,
            prefix_len=jnp.asarray(prefix_len, jnp.int32),
            max_chunk_len=jnp.int32(max([end - start for _, start, end in chunks], default=0)),
            max_item_len=jnp.int32(max(items, default=1)),
            layer=jnp.int32(0),
            positions=jnp.asarray(pos),
            window=NO_WINDOW if window is None else jnp.int32(window),
            split=split,
        )
        return np.asarray(with_meta(xla.paged_attention, *map(jnp.asarray, (q, k, v)), pool_k, pool_v, meta=meta))

    # the query's own tokens: one chunk, two (a second segment over the same pages), or its last 400
    # after another query's chunk
    whole = stream([(0, 0, query)], [], None, 1536)
    two = stream([(0, 0, 700), (1, 700, query)], [], None, 1536)
    late = stream([(2, 0, 200), (1, 1100, query)], [], None, 1536)
    np.testing.assert_array_equal(two[:query], whole[:query])
    np.testing.assert_array_equal(late[200 : 200 + query - 1100], whole[1100:query])
    for length in (20, 45):
        needle = tuple(rng.normal(size=(length, *shape)).astype(np.float32) for shape in ((heads, d), (kv, d), (kv, d)))
        alone = stream([], [length], 0, 512)[:length]
        others = [int(x) for x in rng.integers(3, 61, 12)]
        for at in (0, 3, 7, 12):
            items = others[:at] + [length] + others[at:]
            got = stream([], items, at, 512)
            start = sum(items[:at])
            np.testing.assert_array_equal(
                got[start : start + length], alone, err_msg=f"{length} tokens after {at} items"
            )
        # and at every offset of a 32-token block, after one item: a matrix library may pair or
        # split a contraction by offset (on a Zen 4, odd offsets summed apart from even ones)
        for lead in range(1, 33):
            got = stream([], [lead, length], 1, 512)
            np.testing.assert_array_equal(got[lead : lead + length], alone, err_msg=f"{length} tokens at {lead}")


def check_likelihood(scorer: Scorer) -> None:
    """Two continuations' log-probs at every token, their top log-probs and greedy flags (a short
    one and one past 33 tokens: the CPU attention's two paths for an item's own part): alone cold,
    alone warm, among 31 other continuations of 1-40 tokens at the start, middle and end, and
    beside 7 other contexts' likelihoods, all cold."""
    hay = Haystack(scorer, seed=1)
    rng = hay.rng
    context, needles = ids(rng, 200), [ids(rng, 12), ids(rng, 45)]

    def likelihood(ctx: list[int], items: list[list[int]]) -> tuple[str, ScoreInput]:
        return "likelihood", ScoreInput(query=ctx, items=items, loglikelihood=True, top_logprobs=5)

    alone = hay.alone_cold(*likelihood(context, needles))
    cases = [("alone warm", run_together(hay.scorer, [likelihood(context, needles)])[0], alone)]
    others = [ids(rng, int(n)) for n in rng.integers(1, 41, 31)]
    for at in (0, 15, 31):
        result = run_together(hay.scorer, [likelihood(context, [*others[:at], *needles, *others[at:]])])[0]
        for j in range(len(needles)):
            cases.append((f"needle {j} among 31 continuations at {at + j}", entry(result, at + j), entry(alone, j)))
    hay.scorer.engine.prefix_cache.evict_idle()
    contexts = [likelihood(ids(rng, int(rng.integers(20, 300))), others[:6]) for _ in range(7)]
    cases.append(("cold, beside 7 cold contexts", hay.beside(likelihood(context, needles), contexts, 3), alone))
    for case, got, want in cases:
        assert_same(got, want, case)


@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_a_likelihood_is_the_same_whatever_rides_beside_it(numerics: str) -> None:
    check_likelihood(lm(numerics))


def save_classifier(path) -> str:
    """The classify needles' checkpoint: a Qwen3 sequence classifier of three labels."""
    make_torch_model("qwen3", seed=4, classifier=True, num_labels=3, pad_token_id=0, vocab_size=VOCAB).save_pretrained(
        path
    )
    return str(path)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> str:
    return save_classifier(tmp_path_factory.mktemp("classifier"))


def check_classify(scorer: Scorer) -> None:
    """A classifier's logits for one input: alone cold, alone warm, among 63 inputs of 3-120 tokens
    at the start, middle and end."""
    hay = Haystack(scorer, seed=2)
    rng = hay.rng
    needle = ids(rng, 30)
    alone = hay.alone_cold("classify", ClassifyInput(input=[needle], activation="none"))
    cases = {
        "alone warm": run_together(hay.scorer, [("classify", ClassifyInput(input=[needle], activation="none"))])[0]
    }
    others = [ids(rng, int(n)) for n in rng.integers(3, 121, 63)]
    for at in (0, 31, 63):
        inp = ClassifyInput(input=[*others[:at], needle, *others[at:]], activation="none")
        cases[f"among 63 inputs at {at}"] = entry(run_together(hay.scorer, [("classify", inp)])[0], at)
    for case, got in cases.items():
        assert_same(got, alone if got[0] is not None else entry(alone, 0), case)


@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_a_classification_is_the_same_whatever_rides_beside_it(numerics: str, classifier_dir: str) -> None:
    check_classify(Scorer.load(classifier_dir, buckets=SMALL_BUCKETS, **NUMERICS[numerics]))


def save_embedder(path) -> str:
    """The embedding needles' checkpoint: mean pooling, normalized, a default prompt."""
    from helpers.sentence_checkpoints import st_checkpoint

    return st_checkpoint(path, "mean", include_prompt=True, normalize=True)


def check_embeddings(scorer: Scorer) -> None:
    """A text's embedding (mean pooling, normalized, under the model's default prompt, the prompt a
    cached prefix): alone cold, alone warm, among 63 texts of other lengths at the start, middle and
    end."""
    hay = Haystack(scorer, seed=3)
    rng = hay.rng
    words = "the of a cat sat on mat under warm light while rain fell over hills and quiet towns".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words, n))

    needle = text(25)
    alone = hay.alone_cold("embed", EmbedInput(input=[needle]))
    cases = {"alone warm": run_together(hay.scorer, [("embed", EmbedInput(input=[needle]))])[0]}
    others = [text(int(n)) for n in rng.integers(1, 80, 63)]
    for at in (0, 31, 63):
        inp = EmbedInput(input=[*others[:at], needle, *others[at:]])
        cases[f"among 63 texts at {at}"] = entry(run_together(hay.scorer, [("embed", inp)])[0], at)
    for case, got in cases.items():
        assert_same(got, alone if got[0] is not None else entry(alone, 0), case)


@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_an_embedding_is_the_same_whatever_rides_beside_it(numerics: str, tmp_path_factory) -> None:
    path = save_embedder(tmp_path_factory.mktemp("st"))
    check_embeddings(Scorer.load(path, buckets=SMALL_BUCKETS, **NUMERICS[numerics]))


# what the subprocess below runs, without the suite's fast-compile flags (at XLA's lowest
# optimisation no multiply-add was seen contracted): RoPE over 64 tokens (their own positions)
# alone in a one-tile call, then as the last tile of a call of five; the same through the head's
# row steps, alone in one step and as the last of three
_ONE_CODE_PER_TILE = """
import jax, jax.numpy as jnp, numpy as np
from prefixscore.model.decoder import apply_rope, per_tile
from prefixscore.model.step import head_rows_loop
rng = np.random.default_rng(0)
inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, 64, 2) / 64), jnp.float32)
x = rng.standard_normal((64, 3, 64)).astype(np.float32)
at = np.arange(300, 364, dtype=np.int32)
def rope(x, at):
    return per_tile(lambda y, p: apply_rope(y, p, inv_freq), 64, x[None], at[None])[0]
def call_of(tiles):
    xs = np.concatenate([rng.standard_normal((64 * (tiles - 1), 3, 64)).astype(np.float32), x])
    return np.asarray(jax.jit(rope)(xs, np.concatenate([np.arange(64 * (tiles - 1), dtype=np.int32), at])))[-64:]
def head(rows, n):
    return head_rows_loop(lambda r: apply_rope(r[:, None], jnp.arange(300, 332), inv_freq)[:, 0], (rows,), n, 32)
def rows_of(steps):
    rows = np.concatenate([rng.standard_normal((32 * (steps - 1), 64)).astype(np.float32), x[:32, 0]])
    return np.asarray(jax.jit(head)(rows, jnp.int32(32 * steps)))[-32:]
print(np.array_equal(call_of(1), call_of(5)), np.array_equal(rows_of(1), rows_of(3)))
"""


def test_a_tile_and_a_head_step_run_the_same_code_in_every_call() -> None:
    """model/decoder.py per_tile and model/step.py head_rows_loop: a token's RoPE gives the same
    bits in a call of one tile as in a call of five, and a head row in a call of one step as in a
    call of three, with XLA:CPU's fused multiply-add on (a one-tile call whose loop and slices
    compile away fuses its RoPE into other code, and rounds it otherwise). In a subprocess with
    XLA's default optimisation, as a server runs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", _ONE_CODE_PER_TILE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True"]
