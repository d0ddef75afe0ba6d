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


def test_a_prompt_s_positions_are_the_same_bits_in_any_company(completions_server):
    """A prompt's positions come from its own prefill, computed the same bits however it ran: alone
    (one prefill of the whole prompt, in 64-token chunks); after a prompt that comes first in token
    order and shares its first 60 tokens (it takes positions 1-59 from that one, and its prefill
    starts at 59 over that one's pages: three borrowed and 11 tokens copied); and sent again while
    cached and kept (positions 1-70 kept, its last two computed in a fresh entry over its cached
    pages). Every log-prob, top log-prob and the greedy token are the same bits, and equal
    transformers'."""
    from prefixscore.engine.requests.known_positions import KnownPositions

    scorer, http, torch_model, srv = completions_server
    engine, kind = scorer.engine, srv.server.service.kinds["completions"]
    prompt = CONTEXT + CONTINUATIONS[1]  # 72 tokens
    before = CONTEXT[:60] + [CONTEXT[60] - 1, *CONTINUATIONS[2]]  # sorts first: 264 - 1 at position 60

    def logprobs(prompts: list[list[int]], fresh: bool = True) -> tuple[list, int]:
        if fresh:
            kind.known = KnownPositions()  # nothing kept
            engine.prefix_cache.evict_idle()  # nothing cached
        prefilled = engine.stats["prefill_tokens"]
        body = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][-1]["logprobs"], engine.stats["prefill_tokens"] - prefilled

    alone, prefilled_alone = logprobs([prompt])
    after, prefilled_after = logprobs([prompt, before][::-1])
    again, prefilled_again = logprobs([prompt], fresh=False)
    assert (prefilled_alone, prefilled_after, prefilled_again) == (72, len(before) + 72 - 59, 2)
    assert alone == after == again  # every log-prob, top log-prob and the greedy token: the same bits
    assert_prompt_like_transformers(torch_model, prompt, alone["token_logprobs"][:-1])


def test_completions_take_a_question_s_positions_from_an_earlier_request(completions_server):
    """lm-evaluation-harness's order: a k-shot header, two questions, and their choices split over
    two requests. In the first, a question is computed once for its choices: the prompts in token
    order, each from the first position the one before it does not share, over that one's pages;
    in the second, each choice takes the positions a sibling kept in the first request and computes
    only its own from there, over cached pages. Every position equals transformers' forward of
    its prompt."""
    scorer, http, torch_model, _ = completions_server
    engine = scorer.engine
    header = RNG.integers(0, 320, 40).tolist()
    questions = [RNG.integers(0, 320, 20).tolist(), RNG.integers(0, 320, 25).tolist()]
    choices = [[t, *RNG.integers(0, 320, n).tolist()] for t, n in zip((11, 12, 13), (1, 3, 4), strict=True)]
    assert questions[1][0] < questions[0][0]  # the second question's prompts come first in token order
    first = [header + questions[0] + choices[0], header + questions[1] + choices[0], header + questions[0] + choices[1]]
    second = [
        header + questions[1] + choices[1],
        header + questions[0] + choices[2],
        header + questions[1] + choices[2],
    ]
    # first: [62, 67, 64] tokens, computed in the order 67, 62, 64: the first whole, the second from
    # position 39 (its header's last: the row that gives its question's first token), the third
    # from 59 (it shares the header and its question with the second)
    # second: [69, 65, 70], sharing [65, 60, 65] with a kept prompt (the header and a question): each
    # from the row before its choice, over the pages of a prompt of the first request
    for prompts, want in ((first, 67 + (62 - 39) + (64 - 59)), (second, (69 - 64) + (65 - 59) + (70 - 64))):
        computed, prefilled = engine.stats["tokens"], engine.stats["prefill_tokens"]
        response = http.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0})
        assert response.status_code == 200, response.text
        for prompt, choice in zip(prompts, response.json()["choices"], strict=True):
            assert_prompt_like_transformers(torch_model, prompt, choice["logprobs"]["token_logprobs"])
        assert engine.stats["prefill_tokens"] - prefilled == want
        assert engine.stats["tokens"] - computed == want  # no item: every position from a prefill


def test_a_request_s_prompts_ride_one_call_however_slowly_the_host_queues_them(completions_server, monkeypatch):
    """A request's prompts are queued at once (service/core.py `_queued_together`): the device loop
    plans no call before the last is queued, so three prompts that fit one call take one even when
    each takes the host 50 ms to queue (a loaded host). Queued one by one, the loop started a call
    with the first prompt alone, and the others took calls of their own."""
    import time

    from prefixscore.engine.requests.known_positions import KnownPositions

    scorer, http, torch_model, srv = completions_server
    engine, service = scorer.engine, srv.server.service
    service.kinds["completions"].known = KnownPositions()
    engine.prefix_cache.evict_idle()
    submit = service.worker.submit

    def slowly(unit) -> None:
        submit(unit)
        time.sleep(0.05)

    monkeypatch.setattr(service.worker, "submit", slowly)
    prompts = [[t, *RNG.integers(0, 320, 14).tolist()] for t in (5, 6, 7)]  # no two share a first token
    calls = engine.stats["calls"]
    response = http.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert response.status_code == 200, response.text
    assert engine.stats["calls"] - calls == 1
    for prompt, choice in zip(prompts, response.json()["choices"], strict=True):
        assert_prompt_like_transformers(torch_model, prompt, choice["logprobs"]["token_logprobs"])


def test_a_request_refused_part_way_through_queueing_leaves_nothing_behind(completions_server, monkeypatch):
    """When the loop refuses one of a request's prompts (the queue full: 429 with its retry hint),
    the prompts queued before it are withdrawn before any call takes them: no call runs, nothing
    stays queued or pinned, and the next request is served."""
    from prefixscore.engine.loop.admission import QueueFull

    scorer, http, torch_model, srv = completions_server
    engine, worker = scorer.engine, srv.server.service.worker
    submit = worker.submit

    def refuse_the_second(unit) -> None:
        if refuse_the_second.taken:
            raise QueueFull("the queue holds 1 items (limit 1)", 250)
        refuse_the_second.taken = True
        submit(unit)

    refuse_the_second.taken = False
    monkeypatch.setattr(worker, "submit", refuse_the_second)
    prompts = [[t, *RNG.integers(0, 320, 9).tolist()] for t in (21, 22, 23)]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
    calls = engine.stats["calls"]
    refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 429 and refuse_the_second.taken, refused.text
    assert engine.stats["calls"] == calls
    assert worker.batcher.depth == 0 and engine.prefix_cache.pinned == 0
    monkeypatch.setattr(worker, "submit", submit)
    served = http.post("/v1/completions", json=body)
    assert served.status_code == 200 and engine.stats["calls"] == calls + 1, served.text


def test_completions_plan_computes_each_position_once_whatever_the_company():
    """Host-only: each prompt is one engine request whose rows are its own prefill's
    (engine/requests/completions.py), from its first position that no kept prompt and no prompt
    before it in token order holds (the row before that position: its token's log-prob is this
    prompt's); the positions the request asks for are each counted once. A prompt's plan is the
    same in any order of the request."""
    from conftest import make_torch_model

    from prefixscore.engine.requests.completions import CompletionsInput, plan
    from prefixscore.engine.requests.known_positions import KnownPositions, Positions
    from prefixscore.engine.requests.validation import Limits
    from prefixscore.model.config import config_from_dict

    torch_model = make_torch_model("qwen3")
    raw = {**torch_model.config.to_dict(), "architectures": [type(torch_model).__name__]}
    requests = RequestTokenizer(config_from_dict(raw), None, Limits(page_tokens=128))
    header, q1, q2 = (RNG.integers(0, 300, n).tolist() for n in (150, 30, 12))
    header[0], q1[0], q2[0] = 100, 1, 2  # their order by tokens: q2 + a, then the header's prompts, q1's first
    a, b = [300, 301], [302, 303, 304]

    def rows(prompts: list[list[int]], known: KnownPositions | None = None) -> list[tuple[int, int, int]]:
        """Per prompt (as sent): (its request's first row, its rows, the positions it asks for)."""
        planned = plan(requests, CompletionsInput(prompts, echo=True, max_tokens=0), known)
        out = []
        for prompt, p in zip(prompts, planned.plans, strict=True):
            request = planned.requests[p.part]
            assert request.prefix == tuple(prompt) and not len(request.items)
            out.append((request.prefix_rows, request.answer.rows, request.requested))
        return out

    first, other = header + q1 + a, header + q1 + b  # 182 and 183 tokens, sharing 180
    assert rows([first]) == [(0, 182, 182)]
    # `other` comes after `first` in token order: it takes positions 1 .. 179 from it and computes
    # from row 179 (its token 180's log-prob); the positions asked for: 182 + 3, in either order
    assert rows([first, other]) == [(0, 182, 182), (179, 4, 3)]
    assert rows([other, first]) == [(179, 4, 3), (0, 182, 182)]
    # in any company, a prompt takes from the one before it in token order
    company = [header + q2 + b, first, q2 + a, other, first[:140]]
    plans = rows(company)
    assert plans[1] == (139, 43, 42)  # after first[:140]: all of it but its last token's row
    assert plans[3] == (179, 4, 3)
    assert plans[2] == (0, 14, 14)  # shares nothing
    assert plans[4] == (0, 140, 140)  # first in token order of the header's prompts
    assert plans[0] == (149, 16, 15)  # after `other` (q2 after q1 in token order: 150 shared)
    assert sorted(company) == [company[i] for i in (2, 4, 1, 3, 0)]
    # the same prompt twice: the second takes all but its last position's row from the first
    assert rows([first, first]) == [(0, 182, 182), (180, 2, 1)]
    # kept positions: `other` shares 180 tokens with the kept `first` (positions 1 .. 179)
    known = KnownPositions(page_tokens=16)
    kept = np.asarray(first)
    n = len(kept) - 1
    empty = Positions(
        np.zeros(n, np.float32), np.zeros((n, TOP_LOGPROBS), np.int32), np.zeros((n, TOP_LOGPROBS), np.float32)
    )
    assert known.keep(kept, empty, None, 1) is not None
    assert rows([other], known) == [(179, 4, 3)]
    assert rows([header + q2 + b], known) == [(149, 16, 15)]  # the header's 150
    assert rows([header[:140] + [7]], known) == [(139, 2, 1)]
    # a prompt kept whole, sent again: its last position's row and the next token's
    assert rows([first], known) == [(180, 2, 1)]


def test_sibling_choices_over_a_long_header_take_its_key_steps_together_with_the_same_bits(
    completions_server, monkeypatch
):
    """lm-eval's sibling choices over a header longer than a key step (256 keys here): the CPU
    attention takes the steps their pages hold alike once for a group of them (kernels/paged.py
    SharedSteps), then each goes on alone. Every position equals transformers' forward of its prompt,
    and each prompt's log-probs are the same bits as the prompt alone (nothing kept or cached)."""
    from prefixscore.engine.requests.known_positions import KnownPositions
    from prefixscore.engine.runtime import planner

    scorer, http, torch_model, srv = completions_server
    engine, kind = scorer.engine, srv.server.service.kinds["completions"]
    assert engine.step_sharing is not None  # the CPU attention shares steps
    rng = np.random.default_rng(250)
    header, question = rng.integers(0, 320, 250).tolist(), rng.integers(0, 320, 8).tolist()
    # four choices, their first tokens apart: the first in token order whole (its last chunk 4
    # tokens), each other one 2-5 tokens over its pages, in that chunk's 64-token window
    firsts, lengths = (5, 6, 7, 8), (1, 2, 3, 4)
    prompts = [header + question + [t, *rng.integers(0, 320, n).tolist()] for t, n in zip(firsts, lengths, strict=True)]
    groups: list[int] = []  # the shared steps of each call's groups (the planner's, spied on)

    def counted(chunks, tp, page_tokens, sharing):
        out = planner_shared_steps(chunks, tp, page_tokens, sharing)
        groups.extend(int(out[3][b]) for b in out[0][: out[1]])
        return out

    planner_shared_steps = planner.shared_steps
    monkeypatch.setattr(planner, "shared_steps", counted)

    def send(batch: list[list[int]]) -> list:
        kind.known = KnownPositions()  # nothing kept
        engine.prefix_cache.evict_idle()  # nothing cached
        body = {"prompt": batch, "echo": True, "logprobs": 1, "max_tokens": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return [c["logprobs"] for c in response.json()["choices"]]

    together = send(prompts)
    assert groups and min(groups) >= 1  # a group took the header's first key step
    grouped = len(groups)
    for prompt, got in zip(prompts, together, strict=True):
        assert_prompt_like_transformers(torch_model, prompt, got["token_logprobs"])
        alone = send([prompt])
        assert alone[0] == got  # every log-prob and top log-prob: the same bits
    assert len(groups) == grouped  # alone: no group


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
    """What the device returns for a prompt's own rows, with `_prefix_value` as the model: row i
    reads prefix token prefix_rows + i and targets the next one; its top ids are a function of the
    tokens it reads up to."""
    from prefixscore.model.call_inputs import TOKEN_COLUMNS

    seq = np.asarray(request.prefix)
    first = request.prefix_rows
    rows = np.zeros((len(seq) - first, TOKEN_COLUMNS), np.float32)
    for i, at in enumerate(range(first, len(seq))):
        if at + 1 < len(seq):
            rows[i, 0] = _prefix_value(seq[: at + 2])
        seen = _prefix_value(seq[: at + 1])
        rows[i, 1 : 1 + TOP_LOGPROBS] = seen - np.arange(TOP_LOGPROBS)
        rows[i, 1 + TOP_LOGPROBS :] = (np.arange(TOP_LOGPROBS) + int(-seen * 1000)) % 300
    return rows


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_completions_stitch_every_prompt_position_whatever_the_plan(data):
    """Host-only, against a stand-in model whose log-prob of a token depends only on the tokens up
    to it: over random k-shot requests (headers, questions, choices, in any order, several requests
    sharing one KnownPositions), every prompt position /v1/completions stitches back together from
    the positions it takes (kept, or another prompt's) and its own rows is the one a forward pass
    of that prompt gives, and so are the top next tokens after it."""
    from conftest import make_torch_model

    from prefixscore.engine.requests.completions import CompletionsInput, plan, prompt_logprobs
    from prefixscore.engine.requests.known_positions import KnownPositions
    from prefixscore.engine.requests.validation import Limits
    from prefixscore.model.config import config_from_dict

    torch_model = make_torch_model("qwen3")
    raw = {**torch_model.config.to_dict(), "architectures": [type(torch_model).__name__]}
    requests = RequestTokenizer(config_from_dict(raw), None, Limits())
    tokens = st.lists(st.integers(0, 299), max_size=40)
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
        results = [_device_rows(request) for request in planned.requests]
        for prompt, got in zip(prompts, prompt_logprobs(planned, results, known), strict=True):
            want = [_prefix_value(np.asarray(prompt[: i + 1])) for i in range(1, len(prompt))]
            np.testing.assert_array_equal(got.logprobs[1:], np.asarray(want, np.float32))
            tops = [int(-_prefix_value(np.asarray(prompt[:i])) * 1000) % 300 for i in range(1, len(prompt) + 1)]
            np.testing.assert_array_equal(got.top_ids[1:, 0], tops[:-1])
            assert got.next_top_ids[0] == tops[-1]


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
