"""An item's own likelihood over a cached context equals transformers' log-softmax of the plain
forward pass of `context + continuation`, token by token, with the top log-probs at each position."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from conftest import FAMILY_OPTIONS, ONE_SHAPE_BUCKETS, torch_label_probs
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixscore import Scorer
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import label_scores
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.likelihood import LikelihoodKind, read_likelihoods
from prefixscore.engine.requests.score import ScoreInput
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.model.call_inputs import TOP_LOGPROBS

# the parity test's buckets: a 128-token item region, 64-token prefill chunks, 16-token pages
BUCKETS = ONE_SHAPE_BUCKETS
RNG = np.random.default_rng(4321)
# 70 tokens: two prefill chunks (64 + 6) and five pages, so a continuation's first token is
# read after a chunk boundary and a page boundary
CONTEXT = RNG.integers(0, 320, 70).tolist()
CONTINUATIONS = [RNG.integers(0, 320, n).tolist() for n in (1, 2, 7, 20)]
TOLERANCE = 1e-5  # per token log-prob, float32 against transformers' float32 forward in float64


def torch_logprobs(model, sequence) -> np.ndarray:
    """The oracle: log-softmax over the vocabulary at every position of one plain forward pass. [n, vocab] float64."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([list(sequence)])).logits[0].double(), -1).numpy()


def greedy_continuation(model, context, n: int) -> list[int]:
    """n tokens that transformers' argmax picks after `context`, one at a time."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch_logprobs(model, context + out)[-1].argmax()))
    return out


def assert_like_transformers(model, context, continuations, got) -> None:
    """Each continuation's per-token log-probs, greedy flags, top log-probs and ids, and the top
    next tokens after it, against the oracle's (ids exactly: random weights leave no ties)."""
    assert len(got) == len(continuations)
    for c, item in zip(continuations, got, strict=True):
        lp = torch_logprobs(model, context + c)
        at = lp[len(context) - 1 : -1]  # the rows that predict the continuation's tokens
        assert item.tokens.tolist() == c
        np.testing.assert_allclose(item.logprobs, at[np.arange(len(c)), c], atol=TOLERANCE, rtol=0)
        top = np.argsort(-at, axis=1, kind="stable")[:, :TOP_LOGPROBS]
        assert (item.top_ids == top).all()
        np.testing.assert_allclose(item.top_logprobs, np.take_along_axis(at, top, 1), atol=TOLERANCE, rtol=0)
        assert (item.greedy == (at.argmax(1) == c)).all()
        # a token among the top log-probs has one log-prob, bit for bit (a client compares them)
        own = item.top_ids == np.asarray(c)[:, None]
        assert (item.top_logprobs[own] == np.broadcast_to(item.logprobs[:, None], own.shape)[own]).all()
        next_top = np.argsort(-lp[-1], kind="stable")[:TOP_LOGPROBS]
        assert (item.next_top_ids == next_top).all()
        np.testing.assert_allclose(item.next_top_logprobs, lp[-1][next_top], atol=TOLERANCE, rtol=0)
        assert abs(item.total - at[np.arange(len(c)), c].sum()) <= len(c) * TOLERANCE


# every family the score path serves, in float32: windows crossing the context/continuation
# boundary (Gemma 3's 48-token window under a 70-token context), soft caps on the attention and
# the final logits (Gemma 2 and 3), Gemma's embedding scaling and (1 + w) norms, tied heads
@pytest.mark.parametrize("family", list(FAMILY_OPTIONS))
def test_item_likelihood_matches_transformers(hf_checkpoints, family):
    path, torch_model = hf_checkpoints[family]
    scorer = Scorer.load(str(path), dtype="float32", buckets=BUCKETS)
    greedy = greedy_continuation(torch_model, CONTEXT, 4)
    continuations = [*CONTINUATIONS, greedy]
    got = scorer.loglikelihood_tokens(CONTEXT, continuations)
    assert_like_transformers(torch_model, CONTEXT, continuations, got)
    assert got[-1].is_greedy and got[-1].greedy.all()
    assert not got[3].is_greedy  # 20 random tokens
    assert scorer.last_usage.prompt_tokens == len(CONTEXT) + sum(map(len, continuations))


def test_cache_hits_short_contexts_and_score_requests_beside_likelihoods(hf_checkpoints):
    """The context cached by one request serves the next (no prefill, the same log-probs); a
    one-token context (no prefix: whole sequences) and a score request riding in the same call
    as a likelihood request are each exact."""
    path, torch_model = hf_checkpoints["qwen3"]
    scorer = Scorer.load(str(path), dtype="float32", buckets=BUCKETS)
    engine = scorer.engine
    first = scorer.loglikelihood_tokens(CONTEXT, CONTINUATIONS)
    prefilled = engine.stats["prefill_tokens"]
    again = scorer.loglikelihood_tokens(CONTEXT, CONTINUATIONS[::-1])
    assert engine.stats["prefill_tokens"] == prefilled  # the context came from the prefix cache
    assert scorer.last_usage.cached_tokens == len(CONTEXT) - 1  # its last token travels with each item
    # the same log-probs to float32 rounding: the items sit elsewhere in the call, and XLA's CPU
    # matmul may round a row's log-sum-exp differently there (seen on one CPU model, not another)
    for a, b in zip(first, again[::-1], strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-6, rtol=0)
    # lm-evaluation-harness's shape: (sum, is_greedy) per continuation
    assert scorer.loglikelihood(CONTEXT, CONTINUATIONS) == [(g.total, g.is_greedy) for g in first]

    assert_like_transformers(
        torch_model, CONTEXT[:1], CONTINUATIONS, scorer.loglikelihood_tokens(CONTEXT[:1], CONTINUATIONS)
    )

    # a score request and a likelihood request over another context, in one call (the score
    # request's query is the likelihood's prefix: the context but its last token, which each
    # of its items starts with, so both ride over one prefill)
    context = CONTEXT[5:40]
    labels = (5, 17, 319)
    score = TokenizedRequest(
        tuple(context[:-1]), [context[-1:] + c for c in CONTINUATIONS], labels, label_scores(False), False
    )
    likelihood = scorer.kinds["likelihood"].plan(ScoreInput(context, CONTINUATIONS, loglikelihood=True)).request
    calls = engine.stats["calls"]
    score_unit, likelihood_unit = scorer.runner.run_requests([score, likelihood])
    assert engine.stats["calls"] == calls + 1
    want = torch_label_probs(torch_model, [context + c for c in CONTINUATIONS], labels, False)
    np.testing.assert_allclose(np.log(score_unit.reply.answer), np.log(want), atol=TOLERANCE, rtol=0)
    got = read_likelihoods(likelihood, likelihood_unit.reply.answer)
    assert_like_transformers(torch_model, context, CONTINUATIONS, got)


def test_bad_likelihood_input_is_refused_naming_the_field_before_device_work(tiny_scorer):
    scorer = tiny_scorer
    vocab = scorer.cfg.vocab_size
    calls = scorer.engine.stats["calls"]
    cases = {
        "items": ([1, 2, 3], []),
        "items[1]": ([1, 2, 3], [[4], []]),
        "items[0]": ([1, 2, 3], [[vocab]]),
        "query": ([], [[4]]),
    }
    for field, (context, continuations) in cases.items():
        with pytest.raises(InvalidInput) as err:
            scorer.loglikelihood(context, continuations)
        assert err.value.field == field, (field, err.value)
    limit = scorer.requests.max_sequence_tokens
    with pytest.raises(InvalidInput, match=f"over the limit of {limit}") as err:
        scorer.loglikelihood([1] * (limit - 2), [[4], [5, 6, 7]])
    assert err.value.field == "items[1]"
    # the options of label scores are refused by name, and top_logprobs past 20
    refused = {
        "label_token_ids": dict(label_token_ids=[4]),
        "labels": dict(labels=["a"]),
        "apply_softmax": dict(apply_softmax=True),
        "item_first": dict(item_first=True),
        "truncate": dict(truncate="end"),
        "top_logprobs": dict(top_logprobs=TOP_LOGPROBS + 1),
    }
    for field, options in refused.items():
        with pytest.raises(InvalidInput) as err:
            scorer.kinds["likelihood"].plan(ScoreInput([1, 2], [[3]], loglikelihood=True, **options))
        assert err.value.field == field, (field, err.value)
    assert scorer.engine.stats["calls"] == calls


def test_a_classifier_has_no_likelihood():
    from conftest import make_torch_model

    from prefixscore.model.config import config_from_dict

    classifier = make_torch_model("qwen3", classifier=True, num_labels=2)
    raw = {**classifier.config.to_dict(), "architectures": [type(classifier).__name__]}
    requests = RequestTokenizer(config_from_dict(raw), None)
    assert requests.head.own_rows
    kind = LikelihoodKind(requests)
    for validate in (kind.plan, kind.stream_open):
        with pytest.raises(InvalidInput, match="sequence classifier") as err:
            validate(ScoreInput([1, 2, 3], [[4]], loglikelihood=True))
        assert err.value.field == "loglikelihood"


def test_the_vocabulary_scan_merges_every_slices_top_logits():
    """The head's scan over a vocabulary of several slices (model/step.py vocab_scan: 5,000 rows
    are two VOCAB_CHUNK slices and a remainder of 904) equals float64 numpy: the log-sum-exp of
    the soft-capped logits, and their top TOP_LOGPROBS with ids offset by the shard's first id,
    rows past `real_rows` (a shard's padding) never counted. The test models' vocabularies fit
    one slice, so only this test merges a running top-k with a later slice's."""
    import functools

    import jax

    from prefixscore.model.step import VOCAB_CHUNK, vocab_scan

    rng = np.random.default_rng(7)
    vocab, real, first_id, cap = 5000, 4900, 1000, 30.0
    assert vocab > 2 * VOCAB_CHUNK
    h = rng.standard_normal((3, 16)).astype(np.float32)
    w = (3 * rng.standard_normal((vocab, 16))).astype(np.float32)
    w[real:] = 50.0  # padding rows with the largest logits: counted, they would top every row
    scan = jax.jit(functools.partial(vocab_scan, cap=cap, top=TOP_LOGPROBS, first_id=first_id))
    lse, top_vals, top_ids = (np.asarray(a) for a in scan(h, w, np.int32(real)))
    logits = cap * np.tanh((h.astype(np.float64) @ w[:real].astype(np.float64).T) / cap)
    peak = logits.max(1, keepdims=True)
    np.testing.assert_allclose(
        lse, (peak + np.log(np.exp(logits - peak).sum(1, keepdims=True)))[:, 0], atol=1e-5, rtol=0
    )
    order = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_LOGPROBS]
    assert (order.max(1) >= 2 * VOCAB_CHUNK).any() and (order.min(1) < VOCAB_CHUNK).any()  # from several slices
    assert (top_ids == order + first_id).all()
    np.testing.assert_allclose(top_vals, np.take_along_axis(logits, order, 1), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def completions_server(hf_checkpoints):
    """tiny Qwen3 served over HTTP: (scorer, an httpx client, the transformers model, the server)."""
    import httpx
    from helpers.service import server_config

    from prefixscore.service.process import ServerThread

    path, torch_model = hf_checkpoints["qwen3"]
    scorer = Scorer.load(str(path), dtype="float32", buckets=BUCKETS)
    with ServerThread(server_config(scorer, http_port=0, template="auto")) as srv:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.server.http_port}", timeout=300) as http:
            yield scorer, http, torch_model, srv


def assert_prompt_like_transformers(torch_model, prompt: list[int], token_logprobs: list) -> None:
    """A prompt's echoed log-probs (the first None) equal transformers' forward of it."""
    lp = torch_logprobs(torch_model, prompt)
    assert token_logprobs[0] is None
    np.testing.assert_allclose(
        token_logprobs[1 : len(prompt)], lp[np.arange(len(prompt) - 1), prompt[1:]], atol=TOLERANCE, rtol=0
    )


def test_completions_echo_over_http_equals_transformers(completions_server):
    """OpenAI's /v1/completions as scorers call it (echo, logprobs, max_tokens 1), over HTTP: every
    prompt position's log-prob, its top log-probs and the greedy next token equal transformers'
    forward of that prompt. Prompts of 71-90 tokens sharing 70, each computed from its own prefill:
    the first (in token order) whole, the others from their 70th position over its pages; a prompt
    sent alone (nothing kept or cached) gets the same bits as in company; a later request's prompts
    take the positions the first kept and compute only their own from there."""
    from prefixscore.engine.requests.known_positions import KnownPositions

    scorer, http, torch_model, srv = completions_server
    kind = srv.server.service.kinds["completions"]
    kind.known = KnownPositions()  # the module's earlier tests kept these positions: compute them all
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    k = 5
    prefilled, computed = scorer.engine.stats["prefill_tokens"], scorer.engine.stats["tokens"]
    shared = http.post(
        "/v1/completions",
        json={"prompt": prompts, "echo": True, "logprobs": k, "max_tokens": 1, "temperature": 0},
    )
    assert shared.status_code == 200, shared.text
    # the first prompt in token order whole; each other one from position 69, whose row gives its
    # own token 70's log-prob, over the first's pages (the 69 tokens before: borrowed and copied)
    first = min(prompts)
    assert scorer.engine.stats["prefill_tokens"] - prefilled == len(first) + sum(
        len(p) - 69 for p in prompts if p is not first
    )
    assert scorer.engine.stats["tokens"] - computed == scorer.engine.stats["prefill_tokens"] - prefilled  # no item
    # a later request over the same 70 tokens: positions 1-69 are known (the kept prompts share
    # them), so each computes from 69; the second was sent before, and its prefill runs in a fresh
    # entry beside its cached one (every row it reads is computed for it)
    later = [CONTEXT + c for c in (CONTINUATIONS[3][::-1], CONTINUATIONS[1])]
    computed, prefilled = scorer.engine.stats["tokens"], scorer.engine.stats["prefill_tokens"]
    again = http.post("/v1/completions", json={"prompt": later, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert again.status_code == 200, again.text
    assert scorer.engine.stats["prefill_tokens"] - prefilled == (90 - 69) + (72 - 69)
    assert scorer.engine.stats["tokens"] - computed == (90 - 69) + (72 - 69)
    # alone, nothing kept or cached: the whole prompt in one prefill, the same bits as in company
    kind.known = KnownPositions()
    scorer.engine.prefix_cache.evict_idle()
    single = http.post("/v1/completions", json={"prompt": prompts[2], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert single.status_code == 200, single.text
    body = shared.json()
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, prompts)),
        "completion_tokens": 4,
        "total_tokens": sum(map(len, prompts)) + 4,
    }
    for prompt, choice in zip(prompts, body["choices"], strict=True):
        lp = torch_logprobs(torch_model, prompt)
        at = lp[np.arange(len(prompt) - 1), prompt[1:]]
        got = choice["logprobs"]
        greedy = int(lp[-1].argmax())
        assert got["tokens"] == [f"token_id:{t}" for t in [*prompt, greedy]]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        np.testing.assert_allclose(got["token_logprobs"][1:-1], at, atol=TOLERANCE, rtol=0)
        assert abs(got["token_logprobs"][-1] - lp[-1, greedy]) <= TOLERANCE
        for i, top in enumerate(got["top_logprobs"][1:], start=1):
            row = lp[i - 1]
            want = {f"token_id:{t}": row[t] for t in np.argsort(-row, kind="stable")[:k]}
            want.setdefault(f"token_id:{([*prompt, greedy])[i]}", row[([*prompt, greedy])[i]])
            assert list(top) == list(want)  # the top k, descending, then the token there
            np.testing.assert_allclose(list(top.values()), list(want.values()), atol=TOLERANCE, rtol=0)
    for prompt, choice in zip(later, again.json()["choices"], strict=True):
        lp = torch_logprobs(torch_model, prompt)
        got = choice["logprobs"]["token_logprobs"]
        np.testing.assert_allclose(got[1:], lp[np.arange(len(prompt) - 1), prompt[1:]], atol=TOLERANCE, rtol=0)
    alone = single.json()["choices"][0]["logprobs"]
    assert len(alone["token_logprobs"]) == len(prompts[2])  # max_tokens 0: the prompt only
    # alone or beside three other prompts: the same bits
    assert alone["token_logprobs"][1:] == body["choices"][2]["logprobs"]["token_logprobs"][1:-1]
    assert all(len(top) == 1 for top in alone["top_logprobs"][1:])  # logprobs 0: the token there only


def test_a_context_read_from_a_longer_one_s_pages_gives_the_same_bits(completions_server):
    """A prompt's contexts (32 and 64 tokens here) are read from the pages of the longest context
    of its request that starts with them: alone, its own 64-token one; beside a longer prompt,
    that prompt's 96-token one, prefilled instead of its own. Its log-probs are the same bits
    either way (nothing kept or cached between the two requests), and equal transformers'."""
    from prefixscore.engine.requests.completions import CompletionsInput
    from prefixscore.engine.requests.known_positions import KnownPositions

    scorer, http, torch_model, srv = completions_server
    engine, kind = scorer.engine, srv.server.service.kinds["completions"]
    prompt = CONTEXT + CONTINUATIONS[1]  # 72 tokens: rows 32-63 over 32 tokens, 64-71 over 64
    longer = CONTEXT + CONTINUATIONS[3] + CONTINUATIONS[2]  # 97 tokens: its last context is 96

    def logprobs(prompts: list[list[int]]) -> tuple[list, int]:
        kind.known = KnownPositions()  # nothing kept
        engine.prefix_cache.evict_idle()  # nothing cached
        prefilled = engine.stats["prefill_tokens"]
        body = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"], engine.stats["prefill_tokens"] - prefilled

    kind.known = KnownPositions()  # the module's earlier tests kept these positions: plan them all
    parts = [p.request for p in kind.plan(CompletionsInput([prompt, longer], echo=True, max_tokens=1)).parts]
    # the 32- and 64-token contexts are read from the 96-token one's pages
    assert {(r.prefix, r.read_prefix) for r in parts if r.read_prefix} == {
        (tuple(longer[:96]), 32),
        (tuple(longer[:96]), 64),
    }
    alone, prefilled_alone = logprobs([prompt])
    beside, prefilled_beside = logprobs([prompt, longer])
    assert (prefilled_alone, prefilled_beside) == (64, 96)  # one prefill each: the longest context
    assert alone == beside  # every log-prob, top log-prob and the greedy token: the same bits
    assert_prompt_like_transformers(torch_model, prompt, alone["token_logprobs"])


def test_completions_take_a_question_s_positions_from_an_earlier_request(completions_server):
    """lm-evaluation-harness's order: a k-shot header, two questions, and their choices split over
    two requests. In the first, the prompts' items over contexts cut every 32 tokens run, an
    item two prompts share once, and only the longest context is prefilled (the shorter one is
    read from its pages); in the second, each choice takes the positions a sibling computed in the
    first request and runs only its items from there, over cached contexts but one (which takes the
    header from a cached one). Every position equals transformers' forward of its prompt."""
    scorer, http, torch_model, _ = completions_server
    engine = scorer.engine
    header = RNG.integers(0, 320, 40).tolist()
    questions = [RNG.integers(0, 320, 20).tolist(), RNG.integers(0, 320, 25).tolist()]
    choices = [[t, *RNG.integers(0, 320, n).tolist()] for t, n in zip((11, 12, 13), (1, 3, 4), strict=True)]
    first = [header + questions[0] + choices[0], header + questions[1] + choices[0], header + questions[0] + choices[1]]
    second = [
        header + questions[1] + choices[1],
        header + questions[0] + choices[2],
        header + questions[1] + choices[2],
    ]
    # first: [62, 67, 64] tokens; second: [69, 65, 70], sharing [65, 60, 65] with a first one
    for prompts, shared in ((first, None), (second, [65, 60, 65])):
        computed, prefilled = engine.stats["tokens"], engine.stats["prefill_tokens"]
        response = http.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0})
        prefill = engine.stats["prefill_tokens"] - prefilled
        items = engine.stats["tokens"] - computed - prefill  # item tokens (a row each)
        assert response.status_code == 200, response.text
        for prompt, choice in zip(prompts, response.json()["choices"], strict=True):
            assert_prompt_like_transformers(torch_model, prompt, choice["logprobs"]["token_logprobs"])
        if shared is None:
            # the second prompt's 64-token context; the 32-token one (the header's) is read from it
            assert prefill == 64
            # over nothing: the header's first 33 tokens, once; over 32: 30, 33 and 32 (each prompt
            # its own); over 64: the second prompt's last 3
            assert items == 33 + 30 + 33 + 32 + 3
        else:
            # positions known up to 64, 59 and 64: the items over 64 tokens (5 and 6), and over 32
            # (33) and 64 (1) for the second, whose 64-token context prefills past the header it
            # takes from the first request's context (a 32-token page borrowed, 8 tokens copied)
            assert items == 5 + 6 + 33 + 1
            assert prefill == 64 - len(header)


def test_completions_plan_segments_at_fixed_positions_whatever_the_company():
    """Host-only: a prompt's items (engine/requests/completions.py) are cut at fixed positions,
    whatever else the request holds: its first page's rows (128 tokens here) from whole sequences,
    the first 32 from an item of at most 33 tokens and the others from one of at least 34; past the
    page, every 32 rows from one item of at most 33 tokens over the prompt's tokens before them. So
    each position is computed over the same context, in the same item at the same place, whichever
    prompts ride beside it; an item two prompts share runs once; kept positions skip the items they
    cover; a context is read from the pages of the longest context starting with it (one prefill
    for a prompt's contexts)."""
    from conftest import make_torch_model

    from prefixscore.engine.requests.completions import SEGMENT_ROWS, CompletionsInput, plan
    from prefixscore.engine.requests.known_positions import KnownPositions, Positions
    from prefixscore.engine.requests.validation import Limits
    from prefixscore.model.config import config_from_dict

    assert SEGMENT_ROWS == 32
    torch_model = make_torch_model("qwen3")
    raw = {**torch_model.config.to_dict(), "architectures": [type(torch_model).__name__]}
    requests = RequestTokenizer(config_from_dict(raw), None, Limits(page_tokens=128))
    header, q1, q2 = (RNG.integers(0, 300, n).tolist() for n in (150, 30, 12))
    a, b = [300, 301], [302, 303, 304]

    def items(prompts: list[list[int]], known: KnownPositions | None = None) -> list[list[tuple[int, list[int], int]]]:
        """Per prompt, its items as (context length, item tokens, first row read)."""
        planned = plan(requests, CompletionsInput(prompts, echo=True, max_tokens=0), known)
        parts = [p.request for p in planned.parts]
        assert [r.items_read for r in parts] == sorted((r.items_read for r in parts), reverse=True)
        for r in parts:  # a context is the start of the prefix whose pages it reads
            assert r.items_read <= len(r.prefix) and (r.read_prefix is None or r.read_prefix < len(r.prefix))
        return [
            [(parts[x.part].items_read, parts[x.part].items[x.item], x.rows_from) for x in prompt.pieces]
            for prompt in planned.plans
        ]

    def requested(prompts: list[list[int]], known: KnownPositions | None = None) -> int:
        """The positions the request needs, each once (prefixscore_requested_tokens_total)."""
        planned = plan(requests, CompletionsInput(prompts, echo=True, max_tokens=0), known)
        return sum(p.request.requested for p in planned.parts)

    first = header + q1 + a  # 182 tokens: rows 0-127 over nothing, 128-159 over 128 tokens, 160-181 over 160
    alone = items([first])
    assert requested([first]) == 182
    assert alone == [[(0, first[:33], 0), (0, first[:129], 32), (128, first[128:161], 128), (160, first[160:], 160)]]
    # its contexts are all read from its longest (160 tokens): one prefill
    parts = [p.request for p in plan(requests, CompletionsInput([first], echo=True, max_tokens=0)).parts]
    assert {r.prefix for r in parts} == {tuple(first[:160]), ()}
    # the same items beside other prompts, in any order
    others = [header + q2 + b, header + q1 + b, q2 + a, first[:140]]
    for company in ([first, *others], [*others, first], [others[0], first, others[1]]):
        assert items(company)[company.index(first)] == alone[0]
    # a prompt ending one token into a segment reads its last row from an item of one token
    assert items([first[:161]]) == [[*alone[0][:3], (160, first[160:161], 160)]]
    # a prompt within the first page: whole sequences only, no context
    assert items([first[:100]]) == [[(0, first[:33], 0), (0, first[:100], 32)]]
    assert items([first[:20]]) == [[(0, first[:20], 0)]]
    # an item two prompts share runs once: these share every item but the last
    planned = plan(requests, CompletionsInput([first, header + q1 + b], echo=True, max_tokens=0), None)
    assert planned.plans[0].pieces[:3] == planned.plans[1].pieces[:3]
    assert planned.plans[0].pieces[3] != planned.plans[1].pieces[3]
    assert sum(len(p.request.items) for p in planned.parts) == 5
    # their first 180 positions are the same: asked for once (182 + 183 - 180), in any order
    assert requested([first, header + q1 + b]) == requested([header + q1 + b, first]) == 185
    # header + q1 + b shares 180 tokens with the kept header + q1 + a (positions 1 .. 179): only
    # rows from 179 run, in the item over 160 tokens
    known = KnownPositions(page_tokens=16)
    kept = np.asarray(first)
    n = len(kept) - 1
    empty = Positions(
        np.zeros(n, np.float32), np.zeros((n, TOP_LOGPROBS), np.int32), np.zeros((n, TOP_LOGPROBS), np.float32)
    )
    assert known.keep(kept, empty, None, 1) is not None
    other = header + q1 + b
    assert items([other], known) == [[(160, other[160:], 160)]]
    assert requested([other], known) == 3  # rows 180 .. 182 (179: the kept prompt ran it)
    # sharing only the header (150 tokens: positions 1 .. 149): from row 149, the items over 128 and 160
    other = header + q2 + b
    assert items([other], known) == [[(128, other[128:161], 128), (160, other[160:], 160)]]
    assert requested([other], known) == 15  # rows 150 .. 164
    short = header[:140] + [7]  # rows 139-140: over 128 tokens
    assert items([short], known) == [[(128, short[128:], 128)]]
    assert requested([short], known) == 1


def test_concurrent_completions_over_one_header_each_equal_transformers(completions_server):
    """Requests at once over one header and shared questions (threads): they plan over each other's
    kept prompts and borrow each other's pages while those are being written, and every position
    of every prompt still equals transformers' forward of it."""
    import concurrent.futures

    scorer, http, torch_model, _ = completions_server
    header = RNG.integers(0, 320, 37).tolist()
    questions = [RNG.integers(0, 320, n).tolist() for n in (18, 26, 9)]
    prompts = [header + q + RNG.integers(0, 320, n).tolist() for q in questions for n in (2, 5, 11)]
    order = RNG.permutation(len(prompts))
    batches = [[prompts[i] for i in order[at : at + 3]] for at in range(0, len(prompts), 3)]

    def send(batch: list[list[int]]) -> list:
        response = http.post("/v1/completions", json={"prompt": batch, "echo": True, "logprobs": 1, "max_tokens": 0})
        assert response.status_code == 200, response.text
        return [c["logprobs"]["token_logprobs"] for c in response.json()["choices"]]

    with concurrent.futures.ThreadPoolExecutor(len(batches)) as pool:
        answers = list(pool.map(send, batches))
    for batch, got in zip(batches, answers, strict=True):
        for prompt, token_logprobs in zip(batch, got, strict=True):
            assert_prompt_like_transformers(torch_model, prompt, token_logprobs)
    assert scorer.engine.prefix_cache.pinned == 0  # every context released


def _prefix_value(tokens: np.ndarray) -> float:
    """A stand-in for a causal LM's log-prob of a sequence's last token: a function of the tokens
    up to it only, as the real one is (so any split into context and item must give it back)."""
    return -float(zlib.crc32(np.asarray(tokens, np.int64).tobytes()) % 100_000) / 1000


def _device_rows(request: TokenizedRequest) -> np.ndarray:
    """What the device returns for a likelihood request's token rows, with `_prefix_value` as the
    model: row i of an item reads its token i (after the prefix) and targets token i + 1; its top
    ids are a function of the tokens it reads up to."""
    from prefixscore.model.call_inputs import TOKEN_COLUMNS

    rows = np.zeros((request.items.total, TOKEN_COLUMNS), np.float32)
    prefix = list(request.prefix[: request.items_read])
    for j in range(len(request.items)):
        lo, hi = int(request.items.offsets[j]), int(request.items.offsets[j + 1])
        seq = np.asarray(prefix + request.items.flat[lo:hi].tolist())
        for i in range(hi - lo):
            at = len(prefix) + i
            if at + 1 < len(seq):
                rows[lo + i, 0] = _prefix_value(seq[: at + 2])
            seen = _prefix_value(seq[: at + 1])
            rows[lo + i, 1 : 1 + TOP_LOGPROBS] = seen - np.arange(TOP_LOGPROBS)
            rows[lo + i, 1 + TOP_LOGPROBS :] = (np.arange(TOP_LOGPROBS) + int(-seen * 1000)) % 300
    return rows


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_completions_stitch_every_prompt_position_whatever_the_plan(data):
    """Host-only, against a stand-in model whose log-prob of a token depends only on the tokens up
    to it: over random k-shot requests (headers, questions, choices, in any order, several requests
    sharing one KnownPositions), every prompt position /v1/completions stitches back together from
    its contexts (kept, or another prompt's) and its own rows is the one a forward pass of that
    prompt gives."""
    from conftest import make_torch_model

    from prefixscore.engine.requests.completions import CompletionsInput, plan, prompt_logprobs
    from prefixscore.engine.requests.known_positions import KnownPositions
    from prefixscore.engine.requests.validation import Limits
    from prefixscore.model.config import config_from_dict

    torch_model = make_torch_model("qwen3")
    raw = {**torch_model.config.to_dict(), "architectures": [type(torch_model).__name__]}
    page = data.draw(st.sampled_from([1, 16, 64, 128]))  # the first page's rows: whole sequences
    requests = RequestTokenizer(config_from_dict(raw), None, Limits(page_tokens=page))
    tokens = st.lists(st.integers(0, 299), max_size=40)
    # headers of any length up to past two 32-row segments: a prompt's contexts are read from
    # another prompt's longer one (its pages), and prompts end before, at and after segment ends
    header = data.draw(st.integers(0, 80).flatmap(lambda n: st.lists(st.integers(0, 299), min_size=n, max_size=n)))
    questions = data.draw(st.lists(tokens, min_size=1, max_size=3))
    # few choices, of few token values: prompts repeat, and choices share leading tokens, so later
    # prompts run over positions kept from prompts that themselves ran over kept ones
    choices = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=4))
    known = KnownPositions(data.draw(st.sampled_from([10**6, 20_000])), page_tokens=4)
    for _ in range(data.draw(st.integers(1, 3))):
        prompts = []
        for _ in range(data.draw(st.integers(1, 6))):
            question = data.draw(st.sampled_from(questions))
            choice = data.draw(st.sampled_from(choices))
            prompts.append(header + question + choice)
        planned = plan(requests, CompletionsInput(prompts, echo=True, max_tokens=0), known)
        results = [read_likelihoods(part.request, _device_rows(part.request)) for part in planned.parts]
        for prompt, got in zip(prompts, prompt_logprobs(planned, results, known), strict=True):
            want = [_prefix_value(np.asarray(prompt[: i + 1])) for i in range(1, len(prompt))]
            np.testing.assert_array_equal(got.logprobs[1:], np.asarray(want, np.float32))
            tops = [int(-_prefix_value(np.asarray(prompt[:i])) * 1000) % 300 for i in range(1, len(prompt))]
            np.testing.assert_array_equal(got.top_ids[1:, 0], tops)


def test_prefixes_sharing_leading_tokens_prefill_only_their_own(hf_checkpoints):
    """A new query whose leading tokens a cached query holds takes them: the whole pages they fill
    borrowed, the rest copied into its own page. Its prefill starts after them, and its scores and
    likelihoods equal transformers' forward of the whole sequence. A lender whose pages a failed
    call left to rewrite is prefilled again (the tokens it lends) before the borrower's next work,
    and the borrower's own tokens after them (what it copied or computed over the lender's pages
    is untrusted too)."""
    path, torch_model = hf_checkpoints["qwen3"]
    scorer = Scorer.load(str(path), dtype="float32", buckets=BUCKETS)
    engine, cache = scorer.engine, scorer.engine.prefix_cache
    labels = [5, 17, 319]
    items = [c[:6] or [9] for c in CONTINUATIONS]
    scorer.score(CONTEXT, items, labels)  # the lender: 70 tokens, four whole 16-token pages
    other = CONTEXT[:40] + RNG.integers(0, 320, 25).tolist()  # shares two whole pages and 8 tokens
    assert other[40] != CONTEXT[40]
    prefilled = engine.stats["prefill_tokens"]
    scores = scorer.score(other, items, labels)
    assert engine.stats["prefill_tokens"] - prefilled == len(other) - 40
    assert scorer.last_usage.cached_tokens == 40  # served from the lender's pages
    want = torch_label_probs(torch_model, [other + it for it in items], labels, False)
    np.testing.assert_allclose(np.log(scores), np.log(want), atol=TOLERANCE, rtol=0)
    borrower = cache._entries[tuple(other)]
    lender = borrower.lender
    assert lender is cache._entries[tuple(CONTEXT)] and borrower.pages[:2] == lender.pages[:2]
    assert (borrower.shared, borrower.copied) == (32, 40) and borrower.pages[2] != lender.pages[2]

    # a likelihood over a context (its prefix: all but its last token) sharing 50 tokens with the lender
    context = CONTEXT[:50] + RNG.integers(0, 320, 9).tolist()
    assert context[50] != CONTEXT[50]
    prefilled = engine.stats["prefill_tokens"]
    got = scorer.loglikelihood_tokens(context, CONTINUATIONS)
    assert engine.stats["prefill_tokens"] - prefilled == len(context) - 1 - 50
    assert_like_transformers(torch_model, context, CONTINUATIONS, got)

    # the lender's pages left to rewrite (a failed call wrote them) while a request holds the
    # borrower: what the borrower copied or computed over them is untrusted, and its next request
    # prefills the lender's 40 shared tokens first, then its own again
    epoch = borrower.epoch
    cache.pin(borrower)
    cache.rewrite(lender)
    assert not borrower.ready and borrower.written == 32 and borrower.epoch == epoch + 1
    prefilled = engine.stats["prefill_tokens"]
    again = scorer.score(other, items, labels)
    assert engine.stats["prefill_tokens"] - prefilled == 40 + len(other) - 40 and borrower.ready
    assert lender.written == 40  # only what it lends
    cache.release(borrower)
    np.testing.assert_allclose(np.log(again), np.log(want), atol=TOLERANCE, rtol=0)

    # a lender's shared tokens more than a call's prefill region holds (290 tokens, 128 a call): the
    # borrower's work waits over several calls for them, then reads them
    long_lender = RNG.integers(0, 320, 300).tolist()
    scorer.score(long_lender, items, labels)
    long_borrower = long_lender[:290] + RNG.integers(0, 320, 5).tolist()
    assert long_borrower[290] != long_lender[290]
    scorer.score(long_borrower, items, labels)
    cache.rewrite(cache._entries[tuple(long_lender)])
    prefilled, calls = engine.stats["prefill_tokens"], engine.stats["calls"]
    got = scorer.score(long_borrower, items, labels)
    # the lender's 290 shared tokens, then the borrower's own 5
    assert engine.stats["prefill_tokens"] - prefilled == 290 + 5 and engine.stats["calls"] - calls >= 3
    want = torch_label_probs(torch_model, [long_borrower + it for it in items], labels, False)
    np.testing.assert_allclose(np.log(got), np.log(want), atol=TOLERANCE, rtol=0)


def test_known_positions_find_the_longest_kept_prompt_and_stay_within_their_bytes():
    """/v1/completions keeps prompts' computed positions (engine/requests/known_positions.py): a new prompt
    finds the kept prompt it shares the most tokens with (a partial page included), and a prompt
    kept over another stores only its own positions yet gives back every one. Past its bytes the
    least recently used prompt goes first, with the prompts kept over it; a prompt larger than the
    whole store is not kept."""
    from prefixscore.engine.requests.known_positions import KEY_TOKENS, KnownPositions, Positions

    def positions(tokens: np.ndarray, start: int = 1) -> Positions:
        # a position's log-prob says which it is: -(index + token / 1000)
        at = np.arange(start, len(tokens))
        lp = -(at + tokens[start:] / 1000).astype(np.float32)
        top = np.repeat(tokens[start:, None], TOP_LOGPROBS, axis=1).astype(np.int32)
        return Positions(lp, top, np.repeat(lp[:, None], TOP_LOGPROBS, axis=1))

    header = RNG.integers(0, 320, 3 * KEY_TOKENS + 5)
    first = np.concatenate([header, RNG.integers(0, 320, 30)])
    store = KnownPositions(10**6)
    root = store.keep(first, positions(first), None, 1)
    # a sibling sharing the header and 3 more tokens (past the last whole key page)
    sibling = np.concatenate([first[: len(header) + 3], (first[len(header) + 3 :] + 1) % 320])
    known, shared = store.longest(sibling, len(sibling) - 1)
    assert known is root and shared == len(header) + 3
    child = store.keep(sibling, positions(sibling, shared), root, shared)
    assert child is not None and len(child.own.logprobs) == len(sibling) - shared  # only its own positions
    whole = store.positions(child, len(sibling))
    np.testing.assert_array_equal(whole.logprobs, positions(sibling).logprobs)
    np.testing.assert_array_equal(whole.top_ids, positions(sibling).top_ids)
    # a prompt sharing less than one key page finds nothing
    assert store.longest(np.concatenate([header[: KEY_TOKENS - 1], [999] * 40]), 60) == (None, 0)
    # `most` caps the share (a prompt keeps a token of its own)
    assert store.longest(first, 20)[1] == 20

    assert KnownPositions(0).keep(first, positions(first), None, 1) is None  # larger than the store
    unit = root.nbytes  # every root below has first's length
    share = len(header) + 3

    def fill(touch: bool) -> tuple[KnownPositions, list]:
        small = KnownPositions(3 * unit)
        a = small.keep(first, positions(first), None, 1)
        b = small.keep(sibling, positions(sibling, share), a, share)
        c = small.keep(RNG.integers(0, 320, len(first)), positions(first), None, 1)
        if touch:  # finding the sibling uses it and the prompt it was kept over
            assert small.longest(sibling, len(sibling) - 1) == (b, len(sibling) - 1)
        d = small.keep(RNG.integers(0, 320, len(first)), positions(first), None, 1)
        assert small.bytes <= 3 * unit
        return small, [a, b, c, d]

    small, (a, b, c, d) = fill(touch=False)  # a is the oldest: it goes, and b, kept over it, with it
    assert list(small._recent.values()) == [c, d] and small.longest(sibling, len(sibling) - 1) == (None, 0)
    small, (a, b, c, d) = fill(touch=True)  # c is the oldest
    assert list(small._recent.values()) == [b, a, d]
