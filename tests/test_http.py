"""The HTTP API end to end: one real server (gRPC + HTTP, tiny-qwen3) shared by the module.

Payloads are the shapes SGLang's /v1/score and the Cohere/Jina rerank docs use, sent with
plain httpx; the `cohere` SDK is pointed at the server; scores must equal gRPC's and the
in-process Scorer's bit for bit (one validation pass, one device path).
"""

from __future__ import annotations

import io
import json
import logging

import cohere
import grpc
import httpx
import numpy as np
import pytest
from helpers.service import scrape, server_config

from prefixscore.client import ScoreClient
from prefixscore.service.http_schemas import RerankResponse
from prefixscore.service.process import ServerThread
from prefixscore.telemetry import logs
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

MAX_ITEMS = 64

# SGLang's /v1/score examples (docs and tests): text, and token ids with item_first
SGLANG_TEXT = {
    "model": "Qwen/Qwen3-0.6B",
    "query": "The capital of France is",
    "items": [" Paris", " London", " Berlin"],
    "label_token_ids": [9454, 2753],
    "apply_softmax": True,
}
SGLANG_IDS = {
    "query": [785, 6722, 315, 9625, 374],
    "items": [[12095], [7148], [19846]],
    "label_token_ids": [9454, 2753, 11],
    "item_first": True,
}
# Cohere's rerank quick start
COHERE_QUERY = "What is the capital of the United States?"
COHERE_DOCS = [
    "Carson City is the capital city of the American state of Nevada.",
    "The Commonwealth of the Northern Mariana Islands is a group of islands in the Pacific Ocean. "
    "Its capital is Saipan.",
    "Washington, D.C. (also known as simply Washington or D.C., and officially as the District of Columbia) "
    "is the capital of the United States. It is a federal district.",
    "Capital punishment has existed in the United States since before the United States was a country.",
]
# Jina's rerank example: documents as {"text": ...} objects, top_n, return_documents
JINA = {
    "model": "jina-reranker-v2-base-multilingual",
    "query": "Organic skincare products for sensitive skin",
    "top_n": 3,
    "return_documents": True,
    "documents": [
        {"text": "Organic skincare for sensitive skin with aloe vera and chamomile."},
        {"text": "New makeup trends focus on bold colors and innovative techniques"},
        {"text": "Bio-Hautpflege für empfindliche Haut mit Aloe Vera und Kamille"},
        {"text": "Cuidado de la piel orgánico para piel sensible con aloe vera y manzanilla"},
    ],
}


@pytest.fixture(scope="module")
def server(tiny_scorer):
    with ServerThread(server_config(tiny_scorer, http_port=0, max_items=MAX_ITEMS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.server.http_port}", timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(server):
    with ScoreClient(server.target) as c:
        yield c


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


# ---- /v1/score: SGLang's shape, scores equal gRPC and in process ---------------------------------
@pytest.mark.parametrize("payload", [SGLANG_TEXT, SGLANG_IDS], ids=["text", "token-ids-item-first"])
def test_sglang_examples_score_like_grpc_and_in_process(http, grpc_client, tiny_scorer, payload):
    body = ok(http.post("/v1/score", json=payload))
    assert body["object"] == "scoring" and body["model"] == payload.get("model", "tiny-qwen3")
    args = {k: payload[k] for k in ("query", "items", "label_token_ids")}
    flags = {k: payload.get(k, False) for k in ("apply_softmax", "item_first")}
    expected = tiny_scorer.score(**args, **flags)
    assert body["scores"] == expected  # JSON floats of the same float32 values: exactly equal
    assert grpc_client.score(**args, **flags).scores == expected
    usage = body["usage"]
    assert usage["items"] == 3 and usage["prompt_tokens"] == usage["total_tokens"] > 0
    assert usage["truncated_items"] == [] and usage["truncated_query_tokens"] == 0


def test_a_single_string_item_and_no_items(http):
    one = ok(http.post("/v1/score", json={**SGLANG_TEXT, "items": " Paris"}))
    assert len(one["scores"]) == 1
    assert ok(http.post("/v1/score", json={**SGLANG_TEXT, "items": []}))["scores"] == []


def test_http_and_grpc_items_share_device_calls(server, http, grpc_client):
    """With the worker held, an HTTP and a gRPC request over one (cached) query are queued
    together; released, they run in a single device call."""
    import concurrent.futures

    query = "Shared query for both transports."
    grpc_client.score(query, ["warm the prefix cache"], [9454, 2753])
    before = scrape(server.server.metrics_port)["prefixscore_device_batch_size_count"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with server.server.service.worker.paused():
            via_http = pool.submit(
                http.post, "/v1/score", json={"query": query, "items": ["a", "b"], "label_token_ids": [9454, 2753]}
            )
            via_grpc = pool.submit(grpc_client.score, query, ["c", "d", "e"], [9454, 2753])
            wait_queued(server, 5)
        assert len(ok(via_http.result())["scores"]) == 2 and len(via_grpc.result().scores) == 3
    after = scrape(server.server.metrics_port)["prefixscore_device_batch_size_count"]
    assert after - before == 1


def wait_queued(server, items: int) -> None:
    from helpers.service import wait_for

    wait_for(lambda: server.server.service.worker.depth >= items, what=f"{items} items queued")


# ---- /v1/rerank ------------------------------------------------------------------------------------
def test_cohere_sdk_gets_sorted_results_equal_to_in_process(server, tiny_scorer):
    base = f"http://127.0.0.1:{server.server.http_port}"
    expected = tiny_scorer.rerank(COHERE_QUERY, COHERE_DOCS, top_n=3)
    for client in (cohere.Client(api_key="unused", base_url=base), cohere.ClientV2(api_key="unused", base_url=base)):
        response = client.rerank(model="rerank-v3.5", query=COHERE_QUERY, documents=COHERE_DOCS, top_n=3)
        got = [(r.index, r.relevance_score) for r in response.results]
        assert got == [(r.index, r.relevance_score) for r in expected]
        scores = [s for _, s in got]
        assert scores == sorted(scores, reverse=True) and len(got) == 3


def test_jina_example_and_aliases_and_grpc_agree(http, grpc_client, tiny_scorer):
    body = ok(http.post("/v1/rerank", json=JINA))
    texts = [d["text"] for d in JINA["documents"]]
    expected = tiny_scorer.rerank(JINA["query"], texts, top_n=3)
    assert [(r["index"], r["relevance_score"]) for r in body["results"]] == [
        (r.index, r.relevance_score) for r in expected
    ]
    assert [r["document"]["text"] for r in body["results"]] == [texts[r.index] for r in expected]
    assert body["id"].startswith("rerank-") and body["usage"]["documents"] == 4
    assert ok(http.post("/rerank", json=JINA))["results"] == body["results"]
    via_grpc = grpc_client.rerank(JINA["query"], texts, top_n=3)
    assert [(r.index, r.relevance_score) for r in via_grpc.results] == [(r.index, r.relevance_score) for r in expected]
    assert via_grpc.template == "qwen3-reranker"
    bare = ok(http.post("/v1/rerank", json={**JINA, "return_documents": False}))
    assert all("document" not in r for r in bare["results"])
    # the documented response model, nothing more or less
    assert RerankResponse.model_validate(body).model_dump(exclude_none=True) == body
    tagged = {**JINA, "documents": [{**d, "id": f"doc-{j}"} for j, d in enumerate(JINA["documents"])]}
    echoed = ok(http.post("/v1/rerank", json=tagged))["results"]
    assert [r["document"]["id"] for r in echoed] == [f"doc-{r['index']}" for r in echoed]  # a document's own fields


# ---- truncation -----------------------------------------------------------------------------------
def test_score_truncation_is_reported_and_scores_the_cut_input(server, http, tiny_scorer):
    limits = ScoreClient(server.target).model_info(timeout=30).limits
    room = min(limits.max_item_tokens, limits.max_sequence_tokens - 3)  # after the 3-token query
    long_item = list(range(100, 100 + room + 50))
    payload = {"query": [5, 6, 7], "items": [[9, 10], long_item], "label_token_ids": [1, 2]}
    refused = http.post("/v1/score", json=payload)
    assert refused.status_code == 400 and refused.json()["param"] == "items[1]", refused.text  # SGLang's default
    body = ok(http.post("/v1/score", json={**payload, "truncate": "end"}))
    assert body["usage"]["truncated_items"] == [1] and body["usage"]["truncated_item_tokens"] == 50
    assert body["scores"] == tiny_scorer.score([5, 6, 7], [[9, 10], long_item[:room]], [1, 2])
    for side, kept in (("left", [8, 9]), ("right", [5, 6])):
        q = {"query": [5, 6, 7, 8, 9], "items": [[11]], "label_token_ids": [1, 2]}
        cut = ok(http.post("/v1/score", json={**q, "query_truncation": side, "max_query_tokens": 2}))
        assert cut["usage"]["truncated_query_tokens"] == 3
        assert cut["scores"] == tiny_scorer.score(kept, [[11]], [1, 2])


def test_rerank_max_tokens_per_doc(http, tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    doc = "one two three four five six seven eight nine ten"
    body = ok(http.post("/v1/rerank", json={"query": "numbers", "documents": [doc, "x"], "max_tokens_per_doc": 4}))
    assert body["usage"]["truncated_documents"] == [0]
    ids = tok.encode(" " + doc)
    assert body["usage"]["truncated_tokens"] == len(ids) - 4
    cut_doc = tok.hf.decode(ids[:4])[1:]  # the kept tokens as text, without the separating space
    assert tok.encode(" " + cut_doc) == ids[:4]
    expected = {r.index: r.relevance_score for r in tiny_scorer.rerank("numbers", [cut_doc, "x"])}
    assert {r["index"]: r["relevance_score"] for r in body["results"]} == expected


# ---- the joined-tokenization check ----------------------------------------------------------------
def test_check_tokenization_flags_items_whose_joined_tokens_differ(http, tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    # a query ending in a space (as in SGLang's docs) + "Paris": joined, " Paris" is one token; apart, two
    for query, item, differs in (("The capital of France is", " Paris", False), ("The capital is ", "Paris", True)):
        payload = {"query": query, "items": [item, item], "label_token_ids": [1], "check_tokenization": True}
        body = ok(http.post("/v1/score", json=payload))
        assert (tok.encode(query + item) != tok.encode(query) + tok.encode(item)) is differs
        assert body["joined_tokenization_differs"] == [differs, differs]
    ids = http.post(
        "/v1/score", json={"query": [1], "items": [[2]], "label_token_ids": [1], "check_tokenization": True}
    )
    assert ids.status_code == 400 and ids.json()["param"] == "check_tokenization"


# ---- errors: SGLang's shape, the field named, the right status -------------------------------------
BAD = {
    "label out of vocabulary": ({"query": "q", "items": ["a"], "label_token_ids": [10**6]}, 400, "label_token_ids"),
    "no labels": ({"query": "q", "items": ["a"]}, 400, "label_token_ids"),
    "no query": ({"items": ["a"], "label_token_ids": [1]}, 400, "query"),
    "mixed items": ({"query": "q", "items": ["a", [1]], "label_token_ids": [1]}, 400, "items"),
    "wrong type": ({"query": "q", "items": ["a"], "label_token_ids": "yes"}, 400, "label_token_ids"),
    "bad truncate": ({"query": "q", "items": ["a"], "label_token_ids": [1], "truncate": "start"}, 400, "truncate"),
    "too many items": ({"query": "q", "items": ["a"] * (MAX_ITEMS + 1), "label_token_ids": [1]}, 413, "items"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_score_input(http, name):
    payload, status, field = BAD[name]
    response = http.post("/v1/score", json=payload)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == status and body["param"] == field
    assert body["message"].startswith(field), body


@pytest.mark.parametrize(
    "payload,field",
    [
        ({"query": "q", "documents": [""]}, "documents[0]"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": [{"title": "no text"}]}, "documents[0]"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"documents": ["a"]}, "query"),
    ],
)
def test_bad_rerank_input(http, payload, field):
    response = http.post("/v1/rerank", json=payload)
    assert response.status_code == 400, response.text
    assert response.json()["message"].startswith(field), response.json()


def test_malformed_json_and_unknown_route(http):
    response = http.post("/v1/score", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["object"] == "error"
    assert http.get("/v1/nothing").status_code == 404


# ---- request ids ----------------------------------------------------------------------------------
def test_request_ids_are_echoed_or_made_and_logged(server, http):
    sent = ok_response = http.post("/v1/score", json=SGLANG_TEXT, headers={"x-request-id": "trace-7"})
    assert ok_response.headers["x-request-id"] == "trace-7"
    made = http.post("/v1/score", json={"query": "q"}).headers["x-request-id"]
    assert len(made) == 32 and made != "trace-7"
    del sent
    # gRPC: the same metadata key, echoed in the initial metadata, also on errors
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.ScoreServiceStub(channel)
        call = stub.GetModelInfo.with_call(pb.GetModelInfoRequest(), metadata=(("x-request-id", "grpc-9"),))[1]
        assert dict(call.initial_metadata())["x-request-id"] == "grpc-9"
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(pb.ScoreRequest(), metadata=(("x-request-id", "grpc-10"),))
        assert dict(err.value.initial_metadata())["x-request-id"] == "grpc-10"
    # the request's log lines carry its id
    logs.configure("json", "DEBUG")
    buf = io.StringIO()
    logging.getLogger("prefixscore").handlers[0].setStream(buf)
    try:
        http.post("/v1/score", json=SGLANG_TEXT, headers={"x-request-id": "logged-1"})
    finally:
        logs.configure("json", "INFO")
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    mine = [line for line in lines if line.get("event") == "http_request"]
    assert mine and all(line["request_id"] == "logged-1" for line in mine), lines


def test_truncation_side_reaches_rerank_and_score_from_both_transports(http, grpc_client, server, tiny_scorer):
    """HTTP's truncation_side and gRPC's TruncationSide cut documents (items) from that side:
    the scores are the in-process ones of the same cut."""
    docs = ["one two three four five six seven eight nine ten", "alpha beta gamma delta epsilon zeta eta"]
    for side in ("left", "right"):
        want = tiny_scorer.rerank(COHERE_QUERY, docs, max_tokens_per_doc=3, truncation_side=side)
        body = ok(
            http.post(
                "/v1/rerank",
                json={"query": COHERE_QUERY, "documents": docs, "max_tokens_per_doc": 3, "truncation_side": side},
            )
        )
        assert [(r["index"], r["relevance_score"]) for r in body["results"]] == [
            (r.index, r.relevance_score) for r in want
        ]
        assert body["usage"]["truncated_documents"] == [0, 1]
        stub = pb_grpc.ScoreServiceStub(grpc.insecure_channel(server.target))
        side_pb = pb.TRUNCATION_SIDE_LEFT if side == "left" else pb.TRUNCATION_SIDE_RIGHT
        reply = stub.Rerank(
            pb.RerankRequest(query=COHERE_QUERY, documents=docs, max_tokens_per_doc=3, truncation_side=side_pb)
        )
        assert [(r.index, r.relevance_score) for r in reply.results] == [(r.index, r.relevance_score) for r in want]
    item = list(range(1, 601))  # longer than the 512-token context: cut to fit
    room = tiny_scorer.requests.max_sequence_tokens - 3
    for side, kept in (("left", item[-room:]), ("right", item[:room])):
        body = {
            "query": [7, 8, 9],
            "items": [item],
            "label_token_ids": [5, 6],
            "truncate": "end",
            "truncation_side": side,
        }
        want = tiny_scorer.score([7, 8, 9], [kept], [5, 6])
        np.testing.assert_allclose(ok(http.post("/v1/score", json=body))["scores"], want, rtol=1e-6)
    bad = http.post("/v1/rerank", json={"query": "q", "documents": ["d"], "truncation_side": "middle"})
    assert bad.status_code == 400 and "truncation_side" in bad.text


def test_an_unrecognized_model_under_auto_refuses_rerank_naming_the_flag_and_scores(tiny_scorer):
    """`--template auto` on tiny-qwen3 (random; no published reranker): /v1/rerank answers 400 and
    Rerank FAILED_PRECONDITION naming --template, before any device work; /v1/score serves; the
    model description says why."""
    with ServerThread(server_config(tiny_scorer, http_port=0, template="auto")) as srv:
        base = f"http://127.0.0.1:{srv.server.http_port}"
        refused = httpx.post(f"{base}/v1/rerank", json={"query": "q", "documents": ["d"]}, timeout=60)
        assert refused.status_code == 400 and refused.json()["param"] == "template"
        assert "--template" in refused.json()["message"]
        with ScoreClient(srv.target) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.rerank("q", ["d"])
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--template" in err.value.details()
            info = client.model_info()
            assert info.template == "" and "no published reranker is recognized" in info.template_reason
            scored = client.score("q", ["d"], label_token_ids=[5, 6])
        assert len(scored.scores) == 1
        card = ok(httpx.get(f"{base}/v1/models", timeout=60))["data"][0]
        assert card["template"] is None and card["template_reason"] == info.template_reason


# ---- models, health, readiness, OpenAPI -----------------------------------------------------------
def test_models_health_ready(server, http):
    models = ok(http.get("/v1/models"))
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-qwen3"
    assert models["data"][0]["template"] == "qwen3-reranker"
    assert models["data"][0]["quantization"] == "none" and models["data"][0]["quantized_projections"] is None
    assert ok(http.get("/health"))["status"] == "ok"
    assert ok(http.get("/ready"))["status"] == "ready"
    info = ScoreClient(server.target).model_info(timeout=30)
    assert info.template == "qwen3-reranker"
    assert models["data"][0]["template_reason"] == info.template_reason == "named by --template"


def test_openapi_document_holds_against_the_server(server):
    """schemathesis generates requests from /openapi.json and checks each response: no 5xx,
    documented status codes and content types, bodies that match the schema."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    base = f"http://127.0.0.1:{server.server.http_port}"
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/score", "/v1/rerank", "/v1/models", "/health", "/ready"}
    bounded = settings(
        max_examples=8, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck), database=None
    )
    for operation in operations:

        @bounded
        @given(case=operation.as_strategy())
        def check(case) -> None:
            case.call_and_validate(base_url=base, checks=checks)

        check()


def test_request_bodies_over_the_message_limit_are_refused_unread(tiny_scorer):
    """--max-message-bytes bounds HTTP bodies as it bounds gRPC messages, declared or chunked."""
    limit = 2048
    big = {"query": "q", "items": ["x" * 100] * 40, "label_token_ids": [1]}
    with ServerThread(server_config(tiny_scorer, http_port=0, max_message_bytes=limit)) as srv:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.server.http_port}", timeout=60) as client:
            declared = client.post("/v1/score", json=big)
            assert declared.status_code == 413 and str(limit) in declared.json()["message"]
            payload = json.dumps(big).encode()
            chunks = (payload[i : i + 512] for i in range(0, len(payload), 512))  # no content-length
            chunked = client.post("/v1/score", content=chunks, headers={"content-type": "application/json"})
            assert chunked.status_code == 413
            small = {"query": "q", "items": ["a", "b"], "label_token_ids": [1]}
            assert len(ok(client.post("/v1/score", json=small))["scores"]) == 2


# ---- vLLM's /tokenize and /detokenize ---------------------------------------------------------------
def test_tokenize_and_detokenize_as_transformers_tokenizer(http):
    """vLLM's /tokenize and /detokenize answer as transformers' tokenizer of the served model
    (SmolLM2's, loaded by transformers from its GGUF file on its own): a whole prompt with and
    without special tokens, each token's vocabulary entry, and the text of ids; bad input is a
    400 naming the field."""
    from transformers import AutoTokenizer

    from prefixscore.model.presets import smollm2_gguf_path

    path = smollm2_gguf_path()
    oracle = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    prompt = "Question: What is the capital of France?\nAnswer: Paris, naïvely 東京 ✓"
    for special in (True, False):
        body = ok(
            http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": special, "return_token_strs": True})
        )
        want = oracle(prompt, add_special_tokens=special).input_ids
        assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 8192
        assert body["token_strs"] == oracle.convert_ids_to_tokens(want)
    plain = ok(http.post("/tokenize", json={"model": "x", "prompt": prompt}))
    assert plain["tokens"] == oracle(prompt).input_ids and "token_strs" not in plain
    ids = oracle(prompt).input_ids + [0, 1, 2]  # special tokens are spelled out
    assert ok(http.post("/detokenize", json={"tokens": ids}))["prompt"] == oracle.decode(ids)
    for path_, payload, field in [
        ("/detokenize", {"tokens": [5, 49152]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
    ]:
        refused = http.post(path_, json=payload)
        assert refused.status_code == 400 and refused.json()["param"] == field, (payload, refused.text)


# ---- OpenAI's /v1/completions, as scorers call it ------------------------------------------------
def test_completions_of_text_prompts_tokenize_as_vllm_and_answer_in_openai_shape(http, monkeypatch):
    """A text prompt is encoded whole, as /tokenize encodes it; echo returns its text and tokens
    (each id decoded alone, offsets into the echoed text), the greedy next token is appended, and
    without logprobs there is no logprobs object. /tokenizer_info names the special tokens and
    the chat template, as lm-evaluation-harness's remote tokenizer reads them."""
    prompts = ["The capital of France is", "Bees make"]
    body = ok(http.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 3, "max_tokens": 1}))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    total = 0
    for text, choice in zip(prompts, body["choices"], strict=True):
        ids = ok(http.post("/tokenize", json={"prompt": text}))["tokens"]
        got = choice["logprobs"]
        pieces = [ok(http.post("/detokenize", json={"tokens": [t]}))["prompt"] for t in ids]
        assert got["tokens"][:-1] == pieces and choice["text"] == text + got["tokens"][-1]
        assert "".join(got["tokens"]) == choice["text"]
        assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(len(got["tokens"]))]
        new = got["top_logprobs"][-1]
        assert got["tokens"][-1] == max(new, key=new.get) and got["token_logprobs"][-1] == max(new.values())
        total += len(ids)
    assert body["usage"] == {"prompt_tokens": total, "completion_tokens": 2, "total_tokens": total + 2}
    plain = ok(http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 1, "temperature": 0}))
    assert (
        "logprobs" not in plain["choices"][0]
        and plain["choices"][0]["text"] == body["choices"][0]["logprobs"]["tokens"][-1]
    )
    # a long answer is written off the event loop: the same answer
    from prefixscore.service import http_api

    monkeypatch.setattr(http_api, "INLINE_ANSWER_TOKENS", 0)
    threaded = ok(http.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 3, "max_tokens": 1}))
    assert threaded["choices"] == body["choices"] and threaded["usage"] == body["usage"]
    info = ok(http.get("/tokenizer_info"))
    assert (
        info["eos_token"] == "<|im_end|>"
        and info["bos_token"] == "<|im_start|>"
        and "{% for message" in info["chat_template"]
    )


@pytest.mark.parametrize(
    "payload, field, status",
    [
        ({"prompt": "x"}, "max_tokens", 400),  # left out, OpenAI's 16: more than a scorer returns
        ({"prompt": "x", "max_tokens": 2}, "max_tokens", 400),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),  # no echo: nothing to return
        ({"prompt": "x", "max_tokens": 1, "n": 2}, "n", 400),
        ({"prompt": "x", "max_tokens": 1, "stream": True}, "stream", 400),
        ({"prompt": "x", "max_tokens": 1, "temperature": 0.7}, "temperature", 400),
        ({"prompt": "x", "max_tokens": 1, "logit_bias": {"5": 1.0}}, "logit_bias", 400),
        ({"prompt": "x", "max_tokens": 1, "logprobs": 21}, "logprobs", 400),
        ({"prompt": "x", "max_tokens": 1, "prompt_logprobs": 1}, "prompt_logprobs", 400),
        ({"prompt": "", "max_tokens": 1}, "prompt", 400),
        ({"prompt": [], "max_tokens": 1}, "prompt", 400),
        ({"prompt": [[5], []], "max_tokens": 1}, "prompt[1]", 400),
        ({"prompt": [5, 49152], "max_tokens": 1}, "prompt", 400),
        ({"prompt": [[5], [1, -1]], "max_tokens": 1}, "prompt[1]", 400),
        ({"prompt": [7] * 512, "max_tokens": 1}, "prompt", 400),  # 512 + 1 over the 512-token context
        ({"prompt": ["a", "x" * 2_000_000], "max_tokens": 1}, "prompt[1]", 413),
        ({"max_tokens": 1}, "prompt", 400),
    ],
)
def test_bad_completions_input_is_refused_naming_the_field_before_device_work(server, http, payload, field, status):
    calls = server.server.service.engine.stats["calls"]
    refused = http.post("/v1/completions", json=payload)
    assert refused.status_code == status and refused.json()["param"] == field, refused.text
    assert server.server.service.engine.stats["calls"] == calls
