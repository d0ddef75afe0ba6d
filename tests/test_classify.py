"""Classifier models over the wire, and `/v1/classify`, end to end on real servers.

A tiny Qwen3 classifier (random weights, SmolLM2's tokenizer, one label) behind gRPC and HTTP:
GetModelInfo and /v1/models say which head it has; Score and /v1/score return its head's outputs
as the activation asks, equal to the in-process Scorer's; label tokens sent to it are refused
naming the field; rerank's relevance is the sigmoid of its logit.

`/v1/classify` mirrors vLLM's and SGLang's protocol: request `{"model", "input", "truncate_prompt_tokens",
"user", "use_activation"}` (vLLM's ClassificationCompletionRequest, vllm/entrypoints/pooling/classify/
protocol.py; SGLang's docs/supported_models/retrieval_ranking/classify_models.md), response `{"id":
"classify-...", "object": "list", "created", "model", "data": [{"index", "label", "probs",
"num_classes"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens", ...}}` (vLLM's
ClassificationResponse / ClassificationData), `label` being the label of the highest output.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
from pathlib import Path

import grpc
import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ONE_SHAPE_BUCKETS
from helpers.service import scrape, server_config

from prefixscore import Scorer
from prefixscore.engine.requests.classify import ClassifyInput
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.model import presets
from prefixscore.model.loader import LoadedModel
from prefixscore.model.tokenizer import load_tokenizer
from prefixscore.model.weights import random_params
from prefixscore.service.process import ServerThread
from prefixscore.v1 import score_service_pb2 as pb

PROMPT = (
    "You are a careful grader. Read the question and the answer below and decide whether the answer is "
    "correct, complete and polite. The question: which planet in our solar system is the largest, and what "
    "is it mostly made of? Explain the reasoning in detail, mention the moons if relevant, and keep to the "
    "facts that astronomers agree on. The answer under review follows after the marker.\nAnswer:"
) * 2 + " (graded strictly)"
# pages of 16 tokens: a prompt of a few pages is shared
BUCKETS = dataclasses.replace(ONE_SHAPE_BUCKETS, segments=32)
RESPONSES = [
    " Jupiter, mostly hydrogen and helium.",
    " Saturn is the largest; it is made of rock.",
    " Jupiter. It is a gas giant of hydrogen with some helium, and it has dozens of moons.",
    " I do not know.",
]


@pytest.fixture(scope="module")
def classifier() -> Scorer:
    """tiny-qwen3's shapes with a one-label score head ("relevant") instead of the vocabulary's."""
    base, _ = presets.RANDOM_PRESETS["tiny-qwen3"]
    cfg = dataclasses.replace(base, num_labels=1, label_names=("relevant",), name="tiny-qwen3-classifier")
    params = random_params(cfg, 7, jnp.float32)
    loaded = LoadedModel(cfg.name, cfg, params, load_tokenizer(presets.smollm2_tokenizer_dir()), "float32")
    return Scorer(loaded, ScoringEngine(cfg, params, "float32", BUCKETS), template="none")


@pytest.fixture(scope="module")
def server(classifier):
    with ServerThread(server_config(classifier, http_port=0, template="none")) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.server.http_port}", timeout=120) as client:
        yield client


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["param"] == param and body["message"].startswith(f"{param}: "), body
    return body["message"]


def test_model_info_says_the_head_and_its_labels(server, stub, http):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.head, list(info.label_names)) == ("sequence_classification", ["relevant"])
    card = ok(http.get("/v1/models"))["data"][0]
    assert (card["head"], card["label_names"]) == ("sequence_classification", ["relevant"])


def test_score_returns_the_heads_outputs_as_asked(classifier, stub, http, client):
    query, items = "Is this answer right?", [" yes it is", " no", " maybe later"]
    logits = np.array(classifier.score(query, items, activation="none"))
    sigmoid = 1 / (1 + np.exp(-logits))
    assert logits.shape == (3, 1) and np.ptp(logits) > 0
    body = ok(http.post("/v1/score", json={"query": query, "items": items, "activation": "none"}))
    assert body["scores"] == logits.tolist() and body["label_names"] == ["relevant"]
    default = ok(http.post("/v1/score", json={"query": query, "items": items}))["scores"]
    np.testing.assert_allclose(default, sigmoid, rtol=1e-6)  # auto: one label -> sigmoid
    request = pb.ScoreRequest(
        query=pb.Input(text=query), items=[pb.Input(text=t) for t in items], activation=pb.ACTIVATION_SIGMOID
    )
    response = stub.Score(request)
    assert [list(s.probabilities) for s in response.scores] == default
    assert list(response.label_names) == ["relevant"] and not response.label_token_ids
    result = client.score(query, items, activation="none")  # the Python client
    assert (result.scores, result.label_names) == (logits.tolist(), ["relevant"])


def test_a_stream_and_the_cli_return_the_heads_outputs(classifier, server, client, capsys):
    """A ScoreStream over a classifier (the activation given at its open) and `prefixscore score`
    (--activation, the label names as the table's columns)."""
    from prefixscore import cli

    query, items = "Is this answer right?", [" yes it is", " no"]
    logits = classifier.score(query, items, activation="none")
    with client.stream(query, activation="none") as session:
        assert session.result(session.submit(items)) == logits
    assert cli.main(["score", "--target", server.target, "-q", query, *sum([["-i", i] for i in items], [])]) == 0
    table = capsys.readouterr().out
    assert "relevant" in table.splitlines()[0]
    assert (
        cli.main(["score", "--target", server.target, "-q", query, "-i", items[0], "--activation", "none", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["scores"] == logits[:1] and out["label_names"] == ["relevant"]


def test_label_tokens_sent_to_a_classifier_are_refused_naming_the_field(stub, http):
    body = {"query": "q", "items": [" a"], "label_token_ids": [9454, 2753]}
    message = refused(http.post("/v1/score", json=body), "label_token_ids")
    assert "sequence classifier with 1 label(s) ['relevant']" in message
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(query=pb.Input(text="q"), items=[pb.Input(text=" a")], labels=[" yes"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("labels: ")


def test_rerank_relevance_is_the_sigmoid_of_the_one_logit(classifier, http):
    query, docs = "largest planet", ["Jupiter is the largest planet.", "Bananas are yellow.", "Mars is red."]
    logits = np.array(classifier.score(query, docs, activation="none"))[:, 0]
    results = ok(http.post("/v1/rerank", json={"query": query, "documents": docs}))["results"]
    np.testing.assert_allclose([r["relevance_score"] for r in results], sorted(1 / (1 + np.exp(-logits)))[::-1])
    assert [r["index"] for r in results] == list(np.argsort(-logits, kind="stable"))


def _prefill_tokens(server) -> float:
    return scrape(server.server.metrics_port).get("prefixscore_tokens_total{kind=prefix}", 0.0)


def test_classify_n_responses_to_one_prompt_prefills_the_prompt_once(classifier, server, http):
    """Four inputs of one prompt + a response each: their common tokens, rounded down to whole
    pages, are prefilled once (the server's prefill counter moves by exactly that), and each
    input's probs equal the classifier run on the whole input alone."""
    tok = classifier.model.tokenizer
    inputs = [PROMPT + r for r in RESPONSES]
    ids = [tok.start_ids + tok.encode(text) for text in inputs]
    before = _prefill_tokens(server)
    body = ok(http.post("/v1/classify", json={"model": "grader", "input": inputs, "user": "u1"}))
    prefilled = _prefill_tokens(server) - before
    assert body["object"] == "list" and body["model"] == "grader" and body["id"].startswith("classify-")
    usage = body["usage"]
    page = BUCKETS.page_tokens
    common = next(k for k in range(len(ids[0])) if len({tuple(i[: k + 1]) for i in ids}) > 1)
    assert common % page  # a prompt that ends inside a page: the rest of that page is in each item
    assert usage["prefix_tokens"] == common // page * page >= 2 * page  # the prompt, in whole pages
    assert prefilled == usage["prefix_tokens"]  # once, not once per input
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(map(len, ids)) and usage["completion_tokens"] == 0
    assert usage["truncated_inputs"] == [] and usage["prompt_tokens_details"]["cached_tokens"] == 0
    # each input whole, alone, split elsewhere: all but its last token the query, that token the item
    want = [classifier.score(i[:-1], [i[-1:]])[0] for i in (tok.encode(text) for text in inputs)]
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-5)
    assert all(d["num_classes"] == 1 and d["label"] == "relevant" for d in body["data"])
    again = ok(http.post("/v1/classify", json={"input": inputs}))  # the prompt is cached now
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prefix_tokens"]
    assert _prefill_tokens(server) - before == prefilled


def test_classify_token_ids_truncation_and_raw_logits(classifier, http):
    """vLLM's truncate_prompt_tokens keeps each input's last n tokens; use_activation false
    returns the logits; a single id list is one input."""
    ids = classifier.model.tokenizer.encode(PROMPT)[:40]
    body = ok(http.post("/v1/classify", json={"input": [ids, ids[:30]], "truncate_prompt_tokens": 35}))
    assert body["usage"]["truncated_inputs"] == [0]
    raw = ok(http.post("/v1/classify", json={"input": ids[5:], "use_activation": False}))
    assert len(raw["data"]) == 1
    np.testing.assert_allclose(body["data"][0]["probs"], 1 / (1 + np.exp(-np.array(raw["data"][0]["probs"]))))


@pytest.mark.parametrize(
    "payload,param",
    [
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": [[1, 2], [3, 10**9]]}, "input[1]"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "activation": "tanh"}, "activation"),
        ({"input": "x", "use_activation": False, "activation": "sigmoid"}, "use_activation"),
        ({"input": [[1], "x"]}, "input"),
    ],
)
def test_classify_bad_input_names_the_field(http, payload, param):
    response = http.post("/v1/classify", json=payload)
    assert response.status_code == 400, response.text
    assert response.json()["param"] == param, response.json()


def test_a_causal_lm_classifies_with_its_configured_label_tokens():
    """A causal LM serves /v1/classify once started with label strings: probs = the softmax over
    their tokens' logits at each input's end, label names = the strings; without them, refused."""
    causal = Scorer.load("tiny-qwen3", buckets=BUCKETS)
    tok = causal.model.tokenizer
    text = "Is the sky blue? Answer:"
    with ServerThread(server_config(causal, http_port=0, classify_labels=(" yes", " no"))) as srv:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.server.http_port}", timeout=120) as client:
            body = ok(client.post("/v1/classify", json={"input": [text, text + " Yes"]}))
            card = ok(client.get("/v1/models"))["data"][0]
    assert card["head"] == "causal_lm" and card.get("label_names") is None
    for data, ids in zip(body["data"], (tok.encode(text), tok.encode(text + " Yes")), strict=True):
        # the whole input alone (item_first: no prefix; the last token as the "query")
        want = causal.score(ids[-1:], [ids[:-1]], [tok.token_id(" yes"), tok.token_id(" no")], True, True)[0]
        np.testing.assert_allclose(data["probs"], want, atol=1e-5)
        assert data["num_classes"] == 2 and data["label"] == [" yes", " no"][int(np.argmax(want))]
    with pytest.raises(InvalidInput, match="^input: .*serve --classify-labels"):
        causal.kinds["classify"].plan(ClassifyInput(text))


def test_readme_classify_curl_works(server):
    """The README's /v1/classify example, as written, against the classifier server."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    after = text[text.index("`tests/test_classify.py` runs") :]
    block = after[after.index("```bash") + len("```bash") : after.index("```", after.index("```bash") + 7)]
    argv = [a.replace("localhost:8000", f"127.0.0.1:{server.server.http_port}") for a in shlex.split(block.strip())]
    body = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout)
    assert body["object"] == "list" and len(body["data"]) == 3 and body["usage"]["prefix_tokens"] > 0


def test_reward_model_scores_candidate_turns_of_one_conversation_prefilling_it_once(classifier, server, http):
    """A conversation plus N candidate assistant turns (`messages`: one conversation per candidate):
    each rendered whole by the chat template, the shared turns prefilled once, each result equal
    to the classifier on that rendered conversation alone."""
    conversation = [
        {"role": "system", "content": "You grade answers about astronomy. " * 6},
        {"role": "user", "content": "Which planet is the largest, and what is it made of? Answer in one line."},
    ]
    candidates = ["Jupiter: hydrogen and helium.", "Saturn, made of ice.", "Jupiter, a gas giant."]
    before = _prefill_tokens(server)
    messages = [[*conversation, {"role": "assistant", "content": c}] for c in candidates]
    body = ok(http.post("/v1/classify", json={"messages": messages}))
    assert _prefill_tokens(server) - before == body["usage"]["prefix_tokens"] >= 3 * BUCKETS.page_tokens
    hf = classifier.model.tokenizer.hf
    rendered = [classifier.model.tokenizer.encode(hf.apply_chat_template(m, tokenize=False)) for m in messages]
    assert body["usage"]["prompt_tokens"] == sum(map(len, rendered))
    want = [classifier.score(ids[:-1], [ids[-1:]])[0] for ids in rendered]
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-5)
    one = ok(http.post("/v1/classify", json={"messages": messages[1]}))  # vLLM's form: one conversation
    np.testing.assert_allclose(one["data"][0]["probs"], want[1], atol=1e-5)
    assert refused(http.post("/v1/classify", json={"messages": [[{"role": "user"}]]}), "messages[0][0]")
    assert refused(http.post("/v1/classify", json={"input": "x", "messages": messages}), "input")


def test_score_with_messages_scores_candidate_turns_over_the_cached_conversation(classifier, stub, http):
    """/v1/score and gRPC Score with `messages`: the conversation rendered by the chat template is
    the query (prefilled once, then cached), each item a candidate assistant turn; each score
    equals the classifier on the whole rendered conversation with that turn."""
    conversation = [{"role": "user", "content": "Name the largest planet."}]
    candidates = ["Jupiter.", "Mars, I think.", "It is Jupiter, a gas giant."]
    body = ok(http.post("/v1/score", json={"messages": conversation, "items": candidates, "activation": "none"}))
    tok = classifier.model.tokenizer
    for score, c in zip(body["scores"], candidates, strict=True):
        ids = tok.encode(
            tok.hf.apply_chat_template([*conversation, {"role": "assistant", "content": c}], tokenize=False)
        )
        np.testing.assert_allclose(score, classifier.score(ids[:-1], [ids[-1:]], activation="none")[0], atol=1e-5)
    request = pb.ScoreRequest(
        messages=[pb.ChatMessage(role="user", content="Name the largest planet.")],
        items=[pb.Input(text=c) for c in candidates],
        activation=pb.ACTIVATION_NONE,
    )
    response = stub.Score(request)
    assert [list(s.probabilities) for s in response.scores] == body["scores"]
    assert response.usage.cached_tokens > 0  # the conversation, prefilled by the HTTP request
    assert refused(http.post("/v1/score", json={"messages": conversation, "items": [[1, 2]]}), "items")
    assert refused(http.post("/v1/score", json={"messages": conversation, "query": "q", "items": ["a"]}), "query")


def test_serve_takes_classify_labels_from_a_flag_or_the_environment(monkeypatch):
    from prefixscore import cli

    def labels(*argv: str) -> tuple[str, ...]:
        return cli.config_from_args(cli.build_parser().parse_args(["serve", *argv])).classify_labels

    assert labels("--classify-labels", " yes", " no") == (" yes", " no")
    monkeypatch.setenv("PREFIXSCORE_CLASSIFY_LABELS", " yes, no")
    assert labels() == (" yes", " no")
