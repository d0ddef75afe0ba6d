"""`prefixscore.CrossEncoder` against sentence-transformers' documented contract (return types,
ordering, single-pair results) with a causal reranker template (qwen3-reranker, the HTTP rerank
API's default), in process and from a server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.service import server_config

from prefixscore import CrossEncoder
from prefixscore.service.process import ServerThread

QUERY = "Which city is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "Lyon is a city in France.", "Berlin."]
OTHER = "What colour are bananas?"


@pytest.fixture(scope="module")
def encoder(tiny_scorer):
    return CrossEncoder(tiny_scorer)


def test_predict_scores_each_pair_with_the_rerank_apis_relevance(encoder, tiny_scorer):
    # pairs of two queries, interleaved: each gets its own query's relevance, in the order given
    pairs = [(QUERY, DOCS[0]), (OTHER, DOCS[1]), [QUERY, DOCS[2]], (OTHER, DOCS[3]), (QUERY, DOCS[3])]
    scores = encoder.predict(pairs, batch_size=2)
    assert isinstance(scores, np.ndarray) and scores.dtype == np.float32 and scores.shape == (5,)
    expected = {}
    for q in (QUERY, OTHER):
        docs = [d for pq, d in pairs if pq == q]
        for r in tiny_scorer.rerank(q, docs):
            expected[(q, docs[r.index])] = r.relevance_score
    np.testing.assert_allclose(scores, [expected[(q, d)] for q, d in pairs], rtol=1e-6)
    assert ((scores > 0) & (scores < 1)).all()

    single = encoder.predict((QUERY, DOCS[0]))  # one pair alone: a scalar, as sentence-transformers
    assert isinstance(single, np.float32) and single == pytest.approx(scores[0], rel=1e-6)
    assert isinstance(encoder.predict([QUERY, DOCS[0]]), np.float32)


def test_predict_conversions_and_activation(encoder):
    pairs = [(QUERY, d) for d in DOCS]
    relevance = encoder.predict(pairs)
    logits = encoder.predict(pairs, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(1 / (1 + np.exp(-logits)), relevance, rtol=1e-5)
    np.testing.assert_allclose(encoder.predict(pairs, activation_fn=lambda x: -x), -logits, rtol=1e-6)
    tensor = encoder.predict(pairs, convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
    np.testing.assert_allclose(tensor.numpy(), relevance)
    as_list = encoder.predict(pairs, convert_to_numpy=False)
    assert isinstance(as_list, list) and len(as_list) == 4 and all(isinstance(x, torch.Tensor) for x in as_list)
    np.testing.assert_allclose(encoder.predict(pairs, apply_softmax=True), relevance)  # one label: no change
    with pytest.raises(ValueError, match=r"sentences\[1\]"):
        encoder.predict([(QUERY, DOCS[0]), (QUERY,)])


def test_rank_sorts_by_score_descending(encoder, tiny_scorer):
    ranked = encoder.rank(QUERY, DOCS)
    assert [set(r) for r in ranked] == [{"corpus_id", "score"}] * 4
    scores = [r["score"] for r in ranked]
    assert scores == sorted(scores, reverse=True)
    assert [r["corpus_id"] for r in ranked] == [r.index for r in tiny_scorer.rerank(QUERY, DOCS)]
    top = encoder.rank(QUERY, DOCS, top_k=2, return_documents=True)
    assert top == [{**r, "text": DOCS[r["corpus_id"]]} for r in ranked[:2]]


def test_from_a_server_the_same_scores(tiny_scorer, encoder):
    with ServerThread(server_config(tiny_scorer)) as srv:
        remote = CrossEncoder(target=srv.target)
        pairs = [(QUERY, d) for d in DOCS] + [(OTHER, DOCS[1])]
        np.testing.assert_allclose(remote.predict(pairs), encoder.predict(pairs), rtol=1e-6)
        assert [r["corpus_id"] for r in remote.rank(QUERY, DOCS)] == [r["corpus_id"] for r in encoder.rank(QUERY, DOCS)]
        remote.backend.close()


def _classifier_dir(path, num_labels: int, chat_template: bool, activation: str | None) -> str:
    """A tiny Qwen3ForSequenceClassification with SmolLM2's tokenizer (its vocabulary; pad token
    <|im_end|>, id 2, which transformers' head needs to find each padded row's last token).
    Without chat_template.jinja, sentence-transformers tokenizes `tokenizer(query, document)`;
    `activation`: the class saved in config.json as sentence-transformers saves it."""
    import json
    import shutil

    from conftest import make_torch_model

    from prefixscore.model.presets import smollm2_tokenizer_dir

    model = make_torch_model("qwen3", seed=5, classifier=True, num_labels=num_labels, vocab_size=49152, pad_token_id=2)
    if activation is not None:
        model.config.sentence_transformers = {"activation_fn": activation}
    model.save_pretrained(path)
    assert activation is None or json.loads((path / "config.json").read_text())["sentence_transformers"]
    for f in smollm2_tokenizer_dir().iterdir():
        if chat_template or f.name != "chat_template.jinja":
            shutil.copy(f, path)
    return str(path)


@pytest.mark.parametrize(
    ("num_labels", "chat_template", "activation"),
    [(1, True, None), (1, False, "torch.nn.modules.linear.Identity"), (3, True, None)],
)
def test_a_classifier_scores_as_sentence_transformers(tmp_path, num_labels, chat_template, activation):
    """predict and rank over a sequence classifier equal sentence-transformers' CrossEncoder on
    the same checkpoint: values, shapes, dtypes, order and types (a chat template renders the
    pair as query/document messages; without one the pair is the tokenizer's), with the default
    activation (a sigmoid for one label, logits for several) or the one the checkpoint saved."""
    import sentence_transformers
    from conftest import ONE_SHAPE_BUCKETS

    path = _classifier_dir(tmp_path, num_labels, chat_template, activation)
    st = sentence_transformers.CrossEncoder(path, device="cpu")
    ours = CrossEncoder(path, buckets=ONE_SHAPE_BUCKETS)
    assert ours.num_labels == st.num_labels == num_labels
    # sentence-transformers' choice, which ours must reproduce: the saved one, else by label count
    assert type(st.activation_fn).__name__ == ("Sigmoid" if num_labels == 1 and activation is None else "Identity")
    pairs = [(QUERY, DOCS[0]), (OTHER, DOCS[1]), (QUERY, DOCS[2]), (QUERY, DOCS[3])]
    calls = [((pairs,), {}), ((pairs[1],), {}), ((pairs,), {"activation_fn": torch.nn.Identity()})]
    if num_labels > 1:
        calls.append(((pairs,), {"apply_softmax": True}))
    for args, kwargs in calls:
        want, got = st.predict(*args, **kwargs), ours.predict(*args, **kwargs)
        assert (type(got), got.dtype, got.shape) == (type(want), want.dtype, want.shape)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    want, got = st.predict(pairs, convert_to_tensor=True), ours.predict(pairs, convert_to_tensor=True)
    assert (type(got), got.dtype, got.shape) == (type(want), want.dtype, want.shape)
    want, got = st.predict(pairs, convert_to_numpy=False), ours.predict(pairs, convert_to_numpy=False)
    assert [(type(x), x.dtype, x.shape) for x in got] == [(type(x), x.dtype, x.shape) for x in want]
    if num_labels > 1:
        with pytest.raises(ValueError, match="num_labels=1"):
            ours.rank(QUERY, DOCS)
        return
    assert np.ptp(ours.predict(pairs)) > 1e-3  # the pairs' scores differ: the order below means something
    want, got = (
        st.rank(QUERY, DOCS, top_k=3, return_documents=True),
        ours.rank(QUERY, DOCS, top_k=3, return_documents=True),
    )
    assert [(r["corpus_id"], r["text"]) for r in got] == [(r["corpus_id"], r["text"]) for r in want]
    assert [{k: type(v) for k, v in r.items()} for r in got] == [{k: type(v) for k, v in r.items()} for r in want]
    np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in want], atol=1e-5)
