"""`prefixscore.CrossEncoder` against sentence-transformers' documented contract (return types,
ordering, single-pair results) with a causal reranker template (qwen3-reranker, the HTTP rerank
API's default), in process and from a server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from service_testing import server_config

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
    assert isinstance(as_list, list) and len(as_list) == 4
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
