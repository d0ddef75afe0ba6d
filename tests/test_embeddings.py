"""Embeddings against sentence-transformers itself (the oracle), on tiny checkpoints it writes.

Each checkpoint is a tiny random Qwen3 causal LM (SmolLM2's tokenizer) with a sentence-transformers
Transformer -> Pooling -> Normalize configuration saved beside it, as published decoder embedders
(Qwen3-Embedding, gte-Qwen2) ship: `SentenceTransformer(path).encode` and prefixscore's
`Scorer.embed` read the same directory.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.sentence_checkpoints import QUERY_PROMPT, batch_and_alone, st_checkpoint

from prefixscore import Scorer

TEXTS = [
    "What is the capital of France?",
    "ripe yellow bananas",
    "How do I bake bread at home without a bread machine, using only flour, water and salt?",
    "The quick brown fox jumps over the lazy dog.",
    "Berlin is in Germany",
]
ATOL = 1e-5  # on unit vectors of 64 float32 components; a wrong token or pool moves them by 1e-2 and more


CASES = {  # name -> (pooling mode, include_prompt, normalize)
    "last": ("lasttoken", True, True),
    "mean_without_prompt": ("mean", False, True),
    "mean_with_prompt": ("mean", True, False),
    "cls_without_prompt": ("cls", False, True),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """case -> (sentence-transformers' model, prefixscore's Scorer) over one checkpoint, made once."""
    import sentence_transformers as st
    from conftest import ONE_SHAPE_BUCKETS

    made = {}

    def get(case: str):
        if case not in made:
            path = st_checkpoint(tmp_path_factory.mktemp(case), *CASES[case])
            made[case] = st.SentenceTransformer(path, device="cpu"), Scorer.load(path, buckets=ONE_SHAPE_BUCKETS)
            CHECKPOINTS[case] = path
        return made[case]

    return get


CHECKPOINTS: dict[str, str] = {}  # case -> its checkpoint's directory, once made


@pytest.fixture(params=list(CASES))
def pair(request, pairs):
    return pairs(request.param)


@pytest.fixture(scope="module")
def served(pairs):
    """The last-token checkpoint served over HTTP and gRPC: (sentence-transformers' model, the
    server's HTTP base URL, its metrics port, its gRPC target)."""
    from helpers.service import server_config

    from prefixscore.service.process import ServerThread

    st_model, scorer = pairs("last")
    with ServerThread(server_config(scorer, http_port=0, template="none")) as srv:
        yield st_model, f"http://127.0.0.1:{srv.server.http_port}", srv.server.metrics_port, srv.target


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    assert (np.sum(unit(got) * unit(want), axis=1) >= 1 - 1e-6).all()


@pytest.mark.parametrize("prompt_name", ["query", "document", None])
def test_encode_equals_sentence_transformers(pair, prompt_name):
    """Each text after the named prompt (None: the default, `query`), pooled and normalized as the
    checkpoint says: the whole batch at once, as sentence-transformers encodes it padded."""
    st_model, scorer = pair
    want = st_model.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)
    got = scorer.embed(TEXTS, prompt_name=prompt_name)
    _close(got, want)
    assert np.ptp(want[:, 0]) > 1e-2  # the inputs' embeddings differ: a shared or shifted row would show


def test_a_batch_padded_either_side_equals_each_input_alone(pair):
    """sentence-transformers' batch, padded right and then left, and prefixscore's batch: each
    input gets the embedding it gets alone."""
    st_model, scorer = pair
    alone, padded, batch, each = batch_and_alone(st_model, scorer, TEXTS)
    for got in (*padded, batch, each):
        _close(got, alone)


def test_dimensions_truncate_then_normalize(pair):
    st_model, scorer = pair
    want = st_model.encode(TEXTS, truncate_dim=16, normalize_embeddings=True, convert_to_numpy=True)
    got = scorer.embed(TEXTS, dimensions=16, normalize=True)
    _close(got, want)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_the_prompt_is_prefilled_once_and_cached(pair):
    """The query prompt is the request's prefix: a second request with it reads the cached prompt."""
    _, scorer = pair
    mode = scorer.model.pooling
    scorer.embed(["first request"], prompt_name="query")
    scorer.embed(["second request", "and another"], prompt_name="query")
    if mode.mode == "mean" and mode.include_prompt:  # the prompt is pooled: inputs run whole
        assert scorer.last_usage.cached_tokens == 0
    else:
        # all but its last token, which a text's first may merge into
        assert scorer.last_usage.cached_tokens == len(scorer.model.tokenizer.encode(QUERY_PROMPT)) - 1


def test_openai_sdk_embeddings_create_float_and_base64(served):
    """OpenAI's Python SDK against /v1/embeddings: floats and base64 decode to sentence-transformers'
    embeddings, with OpenAI's usage; `dimensions` and a named prompt (extra_body) as encode's."""
    import openai

    st_model, url, _, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    want = st_model.encode(TEXTS, convert_to_numpy=True)
    # the SDK's default asks for base64 and decodes it itself; asked for explicitly, base64 is
    # the little-endian float32 bytes OpenAI documents
    for encoding_format in (openai.NOT_GIVEN, "float", "base64"):
        res = client.embeddings.create(model="tiny", input=TEXTS, encoding_format=encoding_format)
        assert [d.index for d in res.data] == list(range(len(TEXTS))) and res.model == "tiny"
        if encoding_format == "base64":
            got = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in res.data])
        else:
            got = np.asarray([d.embedding for d in res.data], np.float32)
        _close(got, want)
    tokenizer = st_model.tokenizer
    whole = sum(len(tokenizer(QUERY_PROMPT + t)["input_ids"]) for t in TEXTS)
    assert res.usage.prompt_tokens == res.usage.total_tokens == whole
    one = client.embeddings.create(model="tiny", input=TEXTS[0])  # a string: one embedding
    _close(np.asarray([one.data[0].embedding], np.float32), want[:1])
    res = client.embeddings.create(
        model="tiny", input=TEXTS, dimensions=16, extra_body={"prompt_name": "document"}, encoding_format="float"
    )
    want = st_model.encode(
        TEXTS, prompt_name="document", truncate_dim=16, normalize_embeddings=True, convert_to_numpy=True
    )
    _close(np.asarray([d.embedding for d in res.data], np.float32), want)


def test_token_ids_are_sequences_as_given(served):
    """Token-id inputs: no prompt, no special tokens added; equal to the same ids' text embedded
    with an empty prompt (SmolLM2's tokenizer adds none)."""
    import httpx

    st_model, url, _, _ = served
    ids = [st_model.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    body = httpx.post(f"{url}/v1/embeddings", json={"input": ids}, timeout=60).json()
    want = st_model.encode(TEXTS[:3], prompt="", convert_to_numpy=True)
    _close(np.asarray([d["embedding"] for d in body["data"]], np.float32), want)
    one = httpx.post(f"{url}/v1/embeddings", json={"input": ids[0]}, timeout=60).json()
    _close(np.asarray([one["data"][0]["embedding"]], np.float32), want[:1])


REFUSED = [  # (body, the field the refusal names, its status)
    ({"input": TEXTS, "dimensions": 0}, "dimensions", 400),
    ({"input": TEXTS, "dimensions": 65}, "dimensions", 400),
    ({"input": TEXTS, "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": TEXTS, "prompt_name": "passage"}, "prompt_name", 400),
    ({"input": ["fine", ""]}, "input[1]", 400),
    ({"input": []}, "input", 400),
    ({"input": ["a " * 600]}, "input[0]", 400),  # over the 512-token context
    ({"input": [[1, 2], [3, 49152]]}, "input[1]", 400),  # outside the vocabulary
    ({"input": [[1, 2]], "prompt_name": "query"}, "prompt_name", 400),  # a prompt for token ids
    ({"input": TEXTS, "truncation_direction": "middle"}, "truncation_direction", 400),
    ({"input": ["x"] * 10_001}, "input", 413),  # more inputs than --max-items
]


@pytest.mark.parametrize(("body", "field", "status"), REFUSED, ids=[f for _, f, _ in REFUSED])
def test_bad_input_is_refused_naming_the_field(served, body, field, status):
    import httpx
    from helpers.service import scrape

    _, url, metrics_port, _ = served
    httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[:1]}, timeout=60).raise_for_status()
    device_tokens = _device_tokens(scrape(metrics_port))
    assert device_tokens > 0  # the counter counts this route's work
    r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["message"].startswith(f"{field}: "), r.json()
    assert _device_tokens(scrape(metrics_port)) == device_tokens  # refused before any device work


def _device_tokens(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("prefixscore_tokens_total"))


def test_an_input_over_the_limit_is_cut_when_asked(served):
    """truncate: the input is cut to the model's limit on the stated side (the prompt stays), as a
    sentence-transformers model with that max_seq_length cuts it (the right side)."""
    import httpx

    st_model, url, _, _ = served
    long_text = " ".join(f"word{i}" for i in range(400))
    r = httpx.post(f"{url}/v1/embeddings", json={"input": [long_text], "truncate": True}, timeout=120)
    assert r.status_code == 200, r.text
    kept = r.json()["usage"]["prompt_tokens"]
    assert kept < len(st_model.tokenizer(QUERY_PROMPT + long_text)["input_ids"])
    saved, st_model.max_seq_length = st_model.max_seq_length, kept
    try:
        want = st_model.encode([long_text], convert_to_numpy=True)
    finally:
        st_model.max_seq_length = saved
    _close(np.asarray([r.json()["data"][0]["embedding"]], np.float32), want)
    left = httpx.post(
        f"{url}/v1/embeddings",
        json={"input": [long_text], "truncate": True, "truncation_direction": "left"},
        timeout=120,
    ).json()["data"][0]["embedding"]
    assert np.abs(np.asarray(left) - want[0]).max() > 1e-2  # another side, another embedding


def test_a_model_without_pooling_serves_no_embeddings(tiny_scorer):
    """A causal LM with no sentence-transformers Pooling (and no --pooling): refused, naming the flag."""
    with pytest.raises(ValueError, match="--pooling"):
        tiny_scorer.embed(["text"])


def test_tei_embed_through_huggingface_hubs_client(served, monkeypatch):
    """Text Embeddings Inference's /embed through huggingface_hub's InferenceClient (its
    feature_extraction posts TEI's body to the URL it is given): sentence-transformers' embeddings."""
    from huggingface_hub import InferenceClient, constants

    # the suite runs offline (no hub downloads); this client only reaches the loopback server
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    st_model, url, _, _ = served
    client = InferenceClient(model=f"{url}/embed")
    got = client.feature_extraction(TEXTS, prompt_name="document")
    _close(np.asarray(got, np.float32), st_model.encode(TEXTS, prompt_name="document", convert_to_numpy=True))
    got = client.feature_extraction(TEXTS, dimensions=16)
    want = st_model.encode(TEXTS, truncate_dim=16, normalize_embeddings=True, convert_to_numpy=True)
    _close(np.asarray(got, np.float32), want)


def test_models_reports_the_pooling_and_the_dimensions(served):
    """/v1/models says how the model embeds: sentence-transformers' Pooling mode, the vectors'
    width and its named prompts."""
    import httpx

    st_model, url, _, _ = served
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert card["pooling"] == st_model[1].pooling_mode == "lasttoken"
    assert card["embedding_dimensions"] == st_model.get_embedding_dimension() == 64
    assert card["prompt_names"] == sorted(st_model.prompts)


def test_the_sentence_transformer_class_encodes_as_sentence_transformers(pair):
    """prefixscore.SentenceTransformer's encode and similarity against sentence-transformers' own,
    on the same checkpoint: values, shapes, types; truncate_dim after the model's normalization,
    normalize_embeddings after truncate_dim, as there."""
    import torch

    from prefixscore import SentenceTransformer

    st_model, scorer = pair
    ours = SentenceTransformer(scorer)
    assert ours.get_embedding_dimension() == st_model.get_embedding_dimension()
    assert (ours.prompts, ours.default_prompt_name) == (st_model.prompts, st_model.default_prompt_name)
    calls = [
        ((TEXTS,), {"batch_size": 2}),
        ((TEXTS[0],), {"prompt_name": "document"}),
        ((TEXTS,), {"truncate_dim": 8}),
        ((TEXTS,), {"truncate_dim": 8, "normalize_embeddings": True, "prompt": "Represent this: "}),
    ]
    for args, kwargs in calls:
        want, got = st_model.encode(*args, **kwargs), ours.encode(*args, **kwargs)
        assert (type(got), got.dtype, got.shape) == (type(want), want.dtype, want.shape)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    want, got = st_model.encode(TEXTS, convert_to_tensor=True), ours.encode(TEXTS, convert_to_tensor=True)
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
    a, b = ours.encode(TEXTS[:2]), ours.encode(TEXTS[2:], normalize_embeddings=False, truncate_dim=64)
    assert ours.similarity_fn_name == st_model.similarity_fn_name == "cosine"  # as saved
    try:
        for name in ("cosine", "dot", "euclidean", "manhattan"):
            st_model.similarity_fn_name = ours.similarity_fn_name = name
            want, got = st_model.similarity(a, b), ours.similarity(a, b)
            assert isinstance(got, torch.Tensor) and got.shape == want.shape == (2, 3)
            np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=1e-6)
    finally:
        st_model.similarity_fn_name = "cosine"


def test_a_base_model_checkpoint_as_sentence_transformers_saves_it(tmp_path):
    """The directory sentence-transformers itself saves: a base model (architectures Qwen3Model,
    tensors without the causal LM's `model.` prefix, no head). It embeds as sentence-transformers
    loads it, and a request that needs a head is refused, naming the field."""
    import sentence_transformers as st
    from conftest import ONE_SHAPE_BUCKETS

    st_checkpoint(tmp_path, "lasttoken", True, True)
    saved = tmp_path / "st"
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    st_model, scorer = (
        st.SentenceTransformer(str(saved), device="cpu"),
        Scorer.load(str(saved), buckets=ONE_SHAPE_BUCKETS, template="qwen3-reranker"),
    )
    _close(scorer.embed(TEXTS), st_model.encode(TEXTS, convert_to_numpy=True))
    for call, field in (
        (lambda: scorer.score("query", ["item"], [5, 6]), "label_token_ids"),
        (lambda: scorer.rerank("query", ["doc"]), "documents"),
        (lambda: scorer.loglikelihood("a context", [" more"]), "loglikelihood"),
    ):
        with pytest.raises(ValueError, match=f"^{field}: the model is a base model"):
            call()


@pytest.mark.parametrize("case", ["last", "mean_without_prompt"])
def test_warm_embedding_requests_compile_nothing(pairs, case):
    """An engine that serves embeddings returns the hidden columns from every call, so warm-up
    compiles the shapes last-token requests run, and, for a mean or cls, their token-rows forms
    (a row per token), and a model with a vocabulary head its token-logprob forms: after it,
    requests of every size, with and without the prompt, and score and likelihood requests beside
    them, compile nothing."""
    from conftest import ONE_SHAPE_BUCKETS

    from prefixscore.model.call_inputs import TOP_LOGPROBS
    from prefixscore.telemetry.compiles import CompileCounter

    pairs(case)
    scorer = Scorer.load(CHECKPOINTS[case], buckets=ONE_SHAPE_BUCKETS)  # a new engine: nothing compiled yet
    assert scorer.engine.buckets.hidden == 64 and scorer.engine.buckets.top_logprobs == TOP_LOGPROBS
    scorer.engine.warmup()
    before = CompileCounter.obtained()
    for n in (1, 2, 5):
        scorer.embed(TEXTS[:n])
        scorer.embed(TEXTS[-n:], prompt_name="document")
        scorer.score("a query", ["an item", "another"], [5, 6])
        scorer.loglikelihood("a context", TEXTS[:n])
    assert CompileCounter.obtained() == before, "warm embedding requests compiled"


def test_grpc_embed_from_the_python_client(served):
    """gRPC Embed through the Python client (sync and asyncio): sentence-transformers' embeddings
    with the usage; GetModelInfo reports the pooling; bad input INVALID_ARGUMENT naming the field."""
    import asyncio

    import grpc

    from prefixscore.client import AsyncScoreClient, ScoreClient

    st_model, _, _, target = served
    with ScoreClient(target) as client:
        result = client.embed(TEXTS, prompt_name="query")
        _close(np.asarray(result.embeddings, np.float32), st_model.encode(TEXTS, prompt_name="query"))
        tokenizer = st_model.tokenizer
        assert result.usage.prompt_tokens == sum(len(tokenizer(QUERY_PROMPT + t)["input_ids"]) for t in TEXTS)
        assert result.usage.items == len(TEXTS)
        want = st_model.encode(TEXTS, prompt_name="document", truncate_dim=8, normalize_embeddings=True)
        _close(np.asarray(client.embed(TEXTS, prompt_name="document", dimensions=8).embeddings, np.float32), want)

        async def from_asyncio():
            async with AsyncScoreClient(target) as aclient:
                return (await aclient.embed(TEXTS[:2], prompt="")).embeddings

        _close(np.asarray(asyncio.run(from_asyncio()), np.float32), st_model.encode(TEXTS[:2], prompt=""))
        info = client.model_info()
        assert (info.pooling, info.embedding_dimensions) == ("lasttoken", 64)
        assert list(info.prompt_names) == ["document", "query"]
        with pytest.raises(grpc.RpcError) as refused:
            client.embed(TEXTS, prompt_name="passage")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("prompt_name: ")


def test_grpc_embed_stream_over_a_pinned_prompt(served):
    """EmbedStream (sync and asyncio): the prompt's shared run prefilled at the open and pinned
    while the stream is open; each batch's embeddings are sentence-transformers' (out of order
    submits matched by id); the usage counts every input whole; a bad open or batch ends the
    stream INVALID_ARGUMENT naming the field."""
    import asyncio

    import grpc
    from helpers.service import scrape

    from prefixscore.client import AsyncScoreClient, ScoreClient

    st_model, _, metrics_port, target = served
    tokenizer = st_model.tokenizer
    shared = len(tokenizer(QUERY_PROMPT)["input_ids"]) - 1  # the prompt but its last token
    want = st_model.encode(TEXTS, prompt_name="query")
    with ScoreClient(target) as client:
        with client.embed_stream(prompt_name="query") as stream:
            assert (stream.prefix_tokens, stream.dimensions) == (shared, 64)
            pinned = scrape(metrics_port)["prefixscore_prefix_cache_pinned"]
            assert pinned >= 1  # the prompt stays on the device while the stream is open
            first, second = stream.submit(TEXTS[:3]), stream.submit(TEXTS[3:])
            _close(np.asarray(stream.result(second), np.float32), want[3:])
            _close(np.asarray(stream.result(first), np.float32), want[:3])
            usage = stream.close()
        assert scrape(metrics_port)["prefixscore_prefix_cache_pinned"] == pinned - 1  # unpinned at its end
        assert usage.items == len(TEXTS)
        assert usage.prompt_tokens == sum(len(tokenizer(QUERY_PROMPT + t)["input_ids"]) for t in TEXTS)
        with client.embed_stream(prompt_name="query") as again:
            assert again.cached_tokens == shared  # the prompt from the prefix cache
        with pytest.raises(grpc.RpcError) as refused:
            client.embed_stream(prompt_name="passage")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("prompt_name: ")
        with pytest.raises(grpc.RpcError) as refused, client.embed_stream() as stream:
            stream.send([TEXTS[0], ""])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("input[1]: ")

    async def from_asyncio():
        async with AsyncScoreClient(target) as aclient:
            stream = await aclient.embed_stream(prompt_name="document", dimensions=8)
            got = await stream.send(TEXTS)
            await stream.close()
            return stream.dimensions, got

    dimensions, got = asyncio.run(from_asyncio())
    assert dimensions == 8
    want = st_model.encode(TEXTS, prompt_name="document", truncate_dim=8, normalize_embeddings=True)
    _close(np.asarray(got, np.float32), want)


def test_the_embed_command(served, capsys):
    """`prefixscore embed` against a server: one JSON array per text, sentence-transformers'
    embeddings; a bad prompt name is an error naming it, exit status 1."""
    from prefixscore import cli

    st_model, _, _, target = served
    argv = ["embed", "--target", target, "-i", TEXTS[0], "-i", TEXTS[1], "--prompt-name", "document"]
    assert cli.main(argv) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    _close(np.asarray(got, np.float32), st_model.encode(TEXTS[:2], prompt_name="document"))
    assert cli.main(["embed", "--target", target, "-i", "x", "--prompt-name", "passage"]) == 1
    assert "INVALID_ARGUMENT: prompt_name: " in capsys.readouterr().err


def test_batch_file_lines_of_embeddings(pairs):
    """`/v1/embeddings` lines of a batch file, answered in process as the HTTP API answers them:
    sentence-transformers' embeddings, one prompt's lines under one prefix key, a bad body
    answered with the API's 400 naming its field."""
    from prefixscore.offline.inprocess import ScorerBackend
    from prefixscore.offline.lines import parse

    st_model, scorer = pairs("last")
    bodies = {
        "q1": {"input": TEXTS[:2], "prompt_name": "query"},
        "q2": {"input": TEXTS[2], "prompt_name": "query", "encoding_format": "base64"},
        "d": {"input": TEXTS[3:], "prompt_name": "document", "dimensions": 8},
        "bad": {"input": TEXTS, "dimensions": 0},
    }
    lines = [
        parse(n, json.dumps({"custom_id": cid, "url": "/v1/embeddings", "body": body}).encode())
        for n, (cid, body) in enumerate(bodies.items(), 1)
    ]
    assert lines[0].key == lines[1].key != lines[2].key and [line.items for line in lines] == [2, 1, 2, 5]
    out = {o["custom_id"]: o for o in ScorerBackend(scorer).answer([lines])}
    got = [d["embedding"] for d in out["q1"]["response"]["body"]["data"]]
    _close(np.asarray(got, np.float32), st_model.encode(TEXTS[:2], prompt_name="query"))
    encoded = out["q2"]["response"]["body"]["data"][0]["embedding"]
    _close(np.frombuffer(base64.b64decode(encoded), "<f4")[None], st_model.encode(TEXTS[2:3], prompt_name="query"))
    want = st_model.encode(TEXTS[3:], prompt_name="document", truncate_dim=8, normalize_embeddings=True)
    _close(np.asarray([d["embedding"] for d in out["d"]["response"]["body"]["data"]], np.float32), want)
    assert out["bad"]["response"]["status_code"] == 400 and out["bad"]["error"]["message"].startswith("dimensions: ")


@pytest.mark.parametrize(("mode", "include_prompt"), [("lasttoken", True), ("mean", False)])
def test_a_tokenizer_that_appends_an_end_token(tmp_path, mode, include_prompt):
    """Qwen3-Embedding's tokenizer appends <|endoftext|> to every text, and its last-token pooling
    reads it: the embeddings equal sentence-transformers', the prompt's count leaves the prompt's
    own end token out (a mean without the prompt skips that many), and a cut input keeps its end
    token, as the tokenizer's truncation does."""
    import sentence_transformers as st
    from conftest import ONE_SHAPE_BUCKETS

    path = Path(st_checkpoint(tmp_path, mode, include_prompt, True))
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    end = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, end],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}, end],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    st_model = st.SentenceTransformer(str(path), device="cpu")
    assert st_model.tokenizer(TEXTS[0])["input_ids"][-1] == 0  # the end token is there
    scorer = Scorer.load(str(path), buckets=ONE_SHAPE_BUCKETS)
    _close(scorer.embed(TEXTS), st_model.encode(TEXTS, convert_to_numpy=True))
    scorer.embed(["first"])
    scorer.embed(["second", "third"])
    # the prompt's tokens but its trailing end token, then but its last: all cached
    assert scorer.last_usage.cached_tokens == len(st_model.tokenizer(QUERY_PROMPT)["input_ids"]) - 2
    long_text = " ".join(f"word{i}" for i in range(400))
    cut = scorer.embed([long_text], truncate=True)
    saved, st_model.max_seq_length = st_model.max_seq_length, scorer.last_usage.prompt_tokens
    try:
        _close(cut, st_model.encode([long_text], convert_to_numpy=True))
    finally:
        st_model.max_seq_length = saved


@pytest.mark.parametrize(("pooling", "mode"), [("last", "lasttoken"), ("mean", "mean")])
def test_a_plain_causal_lm_served_with_pooling(tmp_path, pooling, mode):
    """`--pooling last|mean` on a plain causal LM (no modules.json): the embeddings of the same
    weights under sentence-transformers' Pooling of that mode and Normalize, with no prompt; on a
    checkpoint whose modules.json says how it pools, the option is refused by name."""
    import sentence_transformers as st
    from conftest import ONE_SHAPE_BUCKETS

    with_modules = Path(st_checkpoint(tmp_path, mode, True, True))
    plain = tmp_path / "plain"
    shutil.copytree(with_modules, plain)
    (plain / "modules.json").unlink()
    st_model = st.SentenceTransformer(str(with_modules), device="cpu")
    scorer = Scorer.load(str(plain), buckets=ONE_SHAPE_BUCKETS, pooling=pooling)
    _close(scorer.embed(TEXTS), st_model.encode(TEXTS, prompt="", convert_to_numpy=True))
    with pytest.raises(ValueError, match="^pooling: "):
        Scorer.load(str(with_modules), buckets=ONE_SHAPE_BUCKETS, pooling=pooling)
