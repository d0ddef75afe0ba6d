"""A request kind added from outside the package, in this file only: registered, then served over
the generic gRPC `Run` and HTTP `POST /v1/run/{kind}` by the same validation, device loop and
answer as every built-in kind, and checked against transformers. The built-in kinds are served by
the generic routes too, with the answers of their own RPCs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import grpc
import httpx
import numpy as np
import pytest
import torch
from conftest import ONE_SHAPE_BUCKETS
from helpers.service import server_config

from prefixscore import Scorer
from prefixscore.engine.requests import catalog
from prefixscore.engine.requests.answers import LabelScores
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.score import Validated, input_kind
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.model.call_inputs import OUTPUT_FULL
from prefixscore.service.process import ServerThread
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

TOLERANCE = 1e-5  # a log-prob, float32 against transformers' float32 forward read in float64
QUERY = list(range(3, 40))
ITEMS = [[41, 42, 43], [7], [300, 301, 302, 303, 304, 305]]
TOKENS = [5, 17, 200, 319]


@dataclasses.dataclass
class TokenLogprobsInput:
    query: object
    items: object
    token_ids: Sequence[int]


class FixedTokenLogprobs:
    """The toy kind: log p(token | query + item) of a fixed set of token ids at each item's last
    token. It declares its rows as label scores over the whole vocabulary and takes their log."""

    name = "fixed_token_logprobs"
    input_type = TokenLogprobsInput

    def __init__(self, requests: RequestTokenizer) -> None:
        self.requests = requests

    def plan(self, inp: TokenLogprobsInput) -> Validated:
        token_ids = self.requests.label_ids(inp.token_ids, ())
        query = self.requests.query_ids(inp.query)  # type: ignore[arg-type]
        items = self.requests.item_ids(inp.items, input_kind(inp.query))  # type: ignore[arg-type]
        return Validated(self.requests.assemble(query, items, token_ids, LabelScores(OUTPUT_FULL), False))

    def answer(self, plan: Validated, done: Sequence[Done]) -> np.ndarray:
        (probs,) = done
        return np.log(probs.answer)


def transformers_logprobs(torch_model, query: list[int], items: list[list[int]], tokens: list[int]) -> np.ndarray:
    """The oracle: log-softmax over the vocabulary at the last token of each plain `query + item`."""
    out = []
    with torch.no_grad():
        for item in items:
            logits = torch_model(torch.tensor([query + item])).logits[0, -1].double()
            out.append(torch.log_softmax(logits, -1)[tokens].numpy())
    return np.array(out)


@pytest.fixture(scope="module")
def served(hf_checkpoints):
    """A server of the qwen3 checkpoint with the toy kind registered, and the torch model."""
    path, torch_model = hf_checkpoints["qwen3"]
    with catalog.registered(FixedTokenLogprobs.name, lambda context: FixedTokenLogprobs(context.requests)):
        scorer = Scorer.load(str(path), dtype="float32", buckets=ONE_SHAPE_BUCKETS)
        with ServerThread(server_config(scorer, http_port=0, template="none")) as srv:
            yield srv, torch_model
    assert FixedTokenLogprobs.name not in catalog.Kinds(catalog.KindContext(scorer.requests)).names


@pytest.fixture(scope="module")
def http(served):
    srv, _ = served
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.server.http_port}", timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def run_rpc(served):
    srv, _ = served
    channel = grpc.insecure_channel(srv.target)
    yield pb_grpc.ScoreServiceStub(channel)
    channel.close()


def test_a_kind_from_test_code_is_served_over_http_and_grpc(served, http, run_rpc):
    _, torch_model = served
    want = transformers_logprobs(torch_model, QUERY, ITEMS, TOKENS)
    body = {"query": QUERY, "items": ITEMS, "token_ids": TOKENS}
    response = http.post(f"/v1/run/{FixedTokenLogprobs.name}", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["kind"] == FixedTokenLogprobs.name
    np.testing.assert_allclose(answer["result"], want, atol=TOLERANCE, rtol=0)
    assert answer["usage"] == {"prompt_tokens": len(QUERY) + sum(map(len, ITEMS)), "cached_tokens": 0, "items": 3}

    reply = run_rpc.Run(pb.RunRequest(kind=FixedTokenLogprobs.name, input=json.dumps(body)))
    # the same query again: its prefix came from the prefix cache, the answer is the same
    assert json.loads(reply.result) == answer["result"]
    assert (reply.usage.prompt_tokens, reply.usage.cached_tokens, reply.usage.items) == (
        len(QUERY) + sum(map(len, ITEMS)),
        len(QUERY),
        3,
    )


def test_the_generic_routes_name_what_they_refuse(http, run_rpc):
    body = {"query": QUERY, "items": ITEMS, "token_ids": TOKENS}
    refused = [  # (kind, body, the field named)
        ("no_such_kind", body, "kind"),
        (FixedTokenLogprobs.name, {**body, "labels": ["a"]}, "labels"),  # not a field of the kind
        (FixedTokenLogprobs.name, {"query": QUERY, "items": ITEMS}, "token_ids"),  # a field it needs
        (FixedTokenLogprobs.name, {**body, "token_ids": [5, "five"]}, "token_ids[1]"),  # not its type
    ]
    for kind, sent, field in refused:
        response = http.post(f"/v1/run/{kind}", json=sent)
        assert response.status_code == 400, response.text
        assert response.json()["message"].startswith(f"{field}:"), response.json()
        with pytest.raises(grpc.RpcError) as err:
            run_rpc.Run(pb.RunRequest(kind=kind, input=json.dumps(sent)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:"), err.value.details()
    # the kind's own validation, by field, through the generic path
    out_of_vocabulary = http.post(f"/v1/run/{FixedTokenLogprobs.name}", json={**body, "token_ids": [10**9]})
    assert out_of_vocabulary.status_code == 400 and out_of_vocabulary.json()["message"].startswith("label_token_ids")


def test_built_in_kinds_answer_the_generic_path_as_their_own_rpcs(run_rpc):
    score = pb.ScoreRequest(
        query=pb.Input(token_ids=pb.TokenIds(ids=QUERY)),
        items=[pb.Input(token_ids=pb.TokenIds(ids=item)) for item in ITEMS],
        label_token_ids=TOKENS,
    )
    own = [list(s.probabilities) for s in run_rpc.Score(score).scores]
    generic = run_rpc.Run(
        pb.RunRequest(kind="score", input=json.dumps({"query": QUERY, "items": ITEMS, "label_token_ids": TOKENS}))
    )
    np.testing.assert_array_equal(np.float32(json.loads(generic.result)), np.float32(own))
    likelihood = run_rpc.Run(
        pb.RunRequest(kind="likelihood", input=json.dumps({"query": QUERY, "items": ITEMS, "loglikelihood": True}))
    )
    tokens = [item["tokens"] for item in json.loads(likelihood.result)]
    assert tokens == ITEMS
